"""Decode attention's launch policy: which calls the TileLang kernels take, their tiling, and how
many splits of the cache a call runs, from the shape and the GPU's facts (pure Python: no tilelang).

The kernel is bound by reading the caches: its blocks load a tile of keys and values, then
compute on it, so a streaming multiprocessor keeps the memory system busy by holding several
blocks at once, each waiting on its loads while another computes, and, where tiles are copied
whole (``stages``), by each block keeping its next tiles' copies in flight. ``B * Hkv`` blocks serve a
call unsplit; each split of the cache multiplies them, up to one wave of the blocks the GPU holds
at once (``resident_blocks``; a second, partial wave would run at a fraction of the machine), and
adds bytes besides its share of the cache (``split_bytes``: q loaded again, a partial o and lse
written in float32, which the merge kernel reads back). ``splits`` picks the count that
minimises a bound of the call's time counted in bytes at the GPU's bandwidth: for the attend
kernel, the larger of its whole bytes and one block's bytes times the blocks of a wave (a
block's share of the bandwidth while a wave runs), plus the bytes the merge reads. While the
blocks do not fill a wave, a block's share of the cache outweighs the split's own bytes, so
few long sequences split until they fill it (64 query rows of 256 columns too: an earlier rule
that kept a split's own bytes under a sixteenth of its cache bytes left 8 such blocks on 132
multiprocessors for a 4k cache); a batch that fills the wave alone runs unsplit. The count
depends on the caches' capacity, not on the lengths (which are on the device): the same call
shape always launches the same grid, as a captured CUDA graph needs, and a split past a short
sequence's length exits at once.
"""

from __future__ import annotations

import math

import torch

DTYPES = (torch.float16, torch.bfloat16)
#: Head sizes the kernels take: multiples of 32, since the four warps split the head's columns
#: in the P V GEMM and each takes whole 8-column MMA tiles; up to 256 (a block's tiles of
#: 256-wide rows still leave room for two blocks per multiprocessor).
HEAD_DIM_STEP = 32
MAX_HEAD_DIM = 256
#: Positions per tile: 64 rows of keys and of values, 16 KiB each at D = 128 in 16-bit types.
BLOCK_N = 64
#: Four warps: each takes a quarter of a tile's columns in the GEMMs.
THREADS = 128
#: Pipeline stages of the tiles copied whole: the next two tiles' keys and values in flight while
#: one is computed, each stage a tile of keys and one of values in shared memory. H200, bf16,
#: D 128, KV read: 3.5-3.8 TB/s with the guarded element loads (b1 x 32k: 2.4), 4.2-4.4 with
#: three stages (b1 x 32k: 3.2), counting the stages' buffers in the blocks per multiprocessor
#: (two stages without counting them: 2.9-3.3, the split rule planned for blocks that did not fit).
#: Fewer where the stages' buffers would not fit a block's shared memory (64 rows of D 256: two).
STAGES = 3
#: What one multiprocessor of sm_80 and sm_90 holds: threads, 32-bit registers and shared memory
#: (the kernel reads its own GPU's from the device's properties; these are the defaults).
MAX_THREADS_PER_SM = 2048
REGISTERS_PER_SM = 65536
SHARED_PER_SM = 228 * 1024
#: Registers a thread needs besides its share of the accumulators (addresses, loop state, the
#: row statistics, the loads in flight): an estimate the compiler is then held to (the kernel
#: declares the blocks per multiprocessor it is launched for).
BASE_REGISTERS = 48
#: The most query rows a block serves (G * S: the GQA group times the new tokens): 64 keeps a
#: thread's accumulators at D = 256 within its registers, and covers GQA groups of 8 with the 8
#: tokens a speculative step proposes; longer calls are prefill's.
MAX_ROWS = 64


def refusal(dtype: torch.dtype, heads_q: int, heads_kv: int, head_dim: int, new_tokens: int, aligned: bool) -> str | None:
    """Why the TileLang kernels do not take a call, or None when they do. Every load of q and of
    the caches is a 16-byte vector (TileLang vectorises the tiles' copies, the guarded ones too),
    which an address off the 16-byte grid faults on: such calls are the plain-torch
    implementation's."""
    if not aligned:
        return "takes q and caches whose data pointers are 16-byte aligned (its loads are 16-byte vectors), not others"
    if dtype not in DTYPES:
        return f"takes float16 and bfloat16, not {dtype} (the plain-torch implementation serves it)"
    if head_dim % HEAD_DIM_STEP or head_dim > MAX_HEAD_DIM:
        return f"takes head sizes that are multiples of {HEAD_DIM_STEP} up to {MAX_HEAD_DIM}, not {head_dim}"
    rows = heads_q // heads_kv * new_tokens
    if rows > MAX_ROWS:
        return (
            f"takes at most {MAX_ROWS} query rows per kv head (Hq / Hkv * S), not {rows}: a prefill-sized call "
            "is the prefill kernel's"
        )
    return None


def block_rows(heads_q: int, heads_kv: int, new_tokens: int) -> int:
    """The GEMMs' M dimension: the G * S rows of a block, padded to a multiple of 16."""
    rows = heads_q // heads_kv * new_tokens
    return max(16, -(-rows // 16) * 16)


def stages(
    page_size: int, masked: bool, hopper: bool, block_m: int, head_dim: int, itemsize: int,
    shared_per_sm: int = SHARED_PER_SM,
) -> int:
    """The pipeline stages of a call's tiles where a tile can be copied whole: the most, up to
    ``STAGES`` and at least two, whose buffers fit one block's shared memory (what the
    multiprocessor holds less the 1 KiB reserved per block); else 0 (guarded loads). A key mask's
    hidden positions must not be read, and a tile of pages smaller than it is gathered row by row
    through the block table (the kernels take only aligned caches: ``refusal``).
    Hopper (sm_90) only: there the copies are TMA's, in a warp-specialised pipeline; TileLang
    0.1.15 cannot plan the same loop with the asynchronous copies of earlier GPUs (the last
    tile's values are zeroed in the buffer the copy wrote, a second write it refuses)."""
    if not hopper or masked or page_size % BLOCK_N:
        return 0
    for count in range(STAGES, 1, -1):
        if shared_bytes(block_m, head_dim, itemsize, stages=count) + 1024 <= shared_per_sm:
            return count
    return 0


def shared_bytes(block_m: int, head_dim: int, itemsize: int, block_n: int = BLOCK_N, stages: int = 0) -> int:
    """Shared memory of one block: q, a key tile and a value tile per pipeline stage (one without
    a pipeline), and the probabilities."""
    return itemsize * (block_m * head_dim + max(stages, 1) * 2 * block_n * head_dim + block_m * block_n)


def blocks_per_sm(
    block_m: int,
    head_dim: int,
    itemsize: int,
    shared_per_sm: int = SHARED_PER_SM,
    registers_per_sm: int = REGISTERS_PER_SM,
    threads_per_sm: int = MAX_THREADS_PER_SM,
    threads: int = THREADS,
    *,
    stages: int = 0,
) -> int:
    """Blocks one multiprocessor holds at once: as many as its shared memory (1 KiB reserved per
    block; ``stages`` as ``shared_bytes`` counts them), thread slots and registers allow; the
    registers a thread needs are its float32 accumulators (o and the scores of a tile, over the
    ``threads`` that compute) plus ``BASE_REGISTERS``, in steps of 8.

    A pipelined block (``stages`` > 0) runs a producer warp group of as many threads beside them
    (TileLang's warp specialisation on sm_90), each given the same registers: it counts twice
    the threads. Counted once, the launch bounds held D 64's threads to 36-42 registers at six
    and seven blocks, and the kernel ran at 2.4-2.6 TB/s (H200); at four blocks, 64 registers, at
    3.8."""
    block_threads = 2 * threads if stages else threads
    by_shared = shared_per_sm // (shared_bytes(block_m, head_dim, itemsize, stages=stages) + 1024)
    accumulators = (block_m * head_dim + 2 * block_m * BLOCK_N) // threads
    registers = -(-(accumulators + BASE_REGISTERS) // 8) * 8
    by_registers = registers_per_sm // (block_threads * registers)
    return max(1, min(by_shared, threads_per_sm // block_threads, by_registers))


def split_bytes(heads_q: int, heads_kv: int, head_dim: int, new_tokens: int, itemsize: int) -> tuple[int, int]:
    """What one split adds besides its share of the caches: (bytes its block moves: the G * S query
    rows loaded, their partial o and lse written in float32; bytes the merge reads back: those
    partials)."""
    rows = heads_q // heads_kv * new_tokens
    partial = rows * (head_dim + 1) * 4
    return rows * head_dim * itemsize + partial, partial


def splits(batch: int, heads_kv: int, capacity: int, resident: int, position_bytes: int, split_cost: tuple[int, int]) -> int:
    """The split count of a call over caches of ``capacity`` positions of ``position_bytes`` (a
    key and a value) per kv head, ``split_cost`` as ``split_bytes`` gives it: of the counts up to
    one wave of ``resident`` blocks that leave each split at least a tile of positions, the one
    that minimises the time bound of the module's docstring (the smallest where several tie)."""
    attend_fixed, merged = split_cost
    base = max(batch * heads_kv, 1)
    cache = capacity * position_bytes
    most = max(1, min(resident // base, capacity // BLOCK_N))
    best, best_bytes = 1, math.inf
    for count in range(1, most + 1):
        attend = max(base * (cache + count * attend_fixed), resident * (cache / count + attend_fixed))
        merge = base * count * merged if count > 1 else 0
        if attend + merge < best_bytes:
            best, best_bytes = count, attend + merge
    return best
