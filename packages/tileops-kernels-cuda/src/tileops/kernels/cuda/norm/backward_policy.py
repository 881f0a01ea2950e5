"""The norm backward kernels' launch rules: which variant serves a call (refusals), the row
kernel's launch configuration for a row length and dtype, the blocks an SM holds and the row
slots (partial sums) of a call, from the hardware's register, thread and shared-memory budgets
(pure Python: no tilelang). ``backward_programs`` builds the kernels these configurations name.

Modes of the row kernel (``launch_config``):

* ``register``: 16-byte vectors; a thread keeps its slice of the row of x and dy in registers
  between the row's reduction and dx, so x and dy are read once; the column sums live in
  registers, or in shared memory where the register file cannot hold them (``_accumulators``).
  With ``prefetch`` a thread loads its slice of its slot's next row while it reduces and
  writes the current one, and the fused kinds load the row's dresidual_sum before reducing it
  (``_prefetches`` says where; for the fused kinds, ``_fused_vectors`` picks the vectors per
  thread and the prefetch together).
* ``streamed``: any row length; x and dy are read again for dx (from L1/L2, the row was just
  read); each slot keeps its column sums in shared memory where they fit the register mode's
  budget for them (``acc`` "shared": up to 32768 float32 sums a block), else adds them into its
  own partial row in global memory at each row (``acc`` "global", ``shared_sum_bytes`` says
  why). With 16-byte vectors for long aligned rows, element-wise (vec = 1) for every length and
  alignment (the general fallback).
"""

from __future__ import annotations

import math

import torch

from ..powers import pow2_ceil
from .policy import DTYPES, KINDS, MAX_THREADS

VARIANTS = ("register", "streamed", "scalar")

# Hardware facts the rules derive from, the same on every CUDA GPU since sm_50 (Hopper too):
# 64 Ki 32-bit registers and at most 2048 resident threads per SM; 16-byte vector accesses.
REGISTER_FILE = 65536
THREADS_PER_SM = 2048
VECTOR_BYTES = 16
# Registers a thread needs besides the values it holds per column (addresses, statistics,
# temporaries of dx): ptxas for sm_90 gave 121 registers to layer_norm's thread of 16 bf16
# columns (56 held) and 91 to add_rms_norm's with its sums in shared memory (24 held).
_REGISTERS_BESIDES_COLUMNS = 64
# The most 16-byte vectors of x (and of dy) a thread of the register mode holds: rows of up to
# 4 * 1024 vectors (64 KiB) are served in registers; longer ones stream.
_MAX_VECTORS_PER_THREAD = 4
# Shared memory the register mode may give its column sums (the forward's shared mode parks rows
# of up to 128 KiB, within the opt-in shared memory of sm_80 and later).
_SHARED_ACCUMULATOR_BYTES = 128 * 1024
# A slot's partial row costs parts * n * 8 bytes (written, then read by the reduce kernel);
# each slot walks at least enough rows that the partials stay under 1/8 of what the rows move.
_PARTIAL_TRAFFIC_SHARE = 8
BLOCK_THREADS = 256  # short rows share a block up to this many threads


def parts_of(kind: str) -> int:
    """How many column sums the kind reduces: dweight, and dbias for the layer norms."""
    return 2 if kind.endswith("layer_norm") else 1



def refusal(
    kind: str, variant: str, n: int, dtype: torch.dtype, aligned: bool, shared_per_block: int | None = None
) -> str | None:
    """None if ``variant`` serves (kind, n, dtype, aligned) on a GPU that gives a block at most
    ``shared_per_block`` bytes of shared memory (None: not known, taken as enough), else why not."""
    if dtype not in DTYPES:
        return (f"dtype {dtype} is not supported by the TileLang backward kernels (float16, bfloat16, float32); "
                "the torch implementation serves it")
    if n < 1:
        return f"N={n}: the normalised dimension must hold at least one element"
    if variant == "scalar":
        return None
    if (n * dtype.itemsize) % VECTOR_BYTES:
        return f"rows of {n * dtype.itemsize} bytes are not a multiple of 16: 16-byte vectors need N a multiple of " \
               f"{VECTOR_BYTES // dtype.itemsize}; the 'scalar' variant serves any N"
    if not aligned:
        return "a data pointer is not 16-byte aligned: the 'scalar' variant serves it"
    if variant == "register" and launch_config(kind, variant, n, dtype)["acc"] is None:
        return (f"a row of {n * dtype.itemsize} bytes does not fit the register mode (x and dy in at most "
                f"{_MAX_VECTORS_PER_THREAD} vectors per thread of 1024, the column sums in registers or "
                f"{_SHARED_ACCUMULATOR_BYTES} bytes of shared memory): the 'streamed' variant serves it")
    if variant == "register" and shared_per_block is not None:
        need = block_shared_bytes(kind, n, launch_config(kind, variant, n, dtype))
        if need > shared_per_block:
            return (f"a row of {n * dtype.itemsize} bytes takes {need} bytes of shared memory a block (its column sums) "
                    f"and this GPU gives a block at most {shared_per_block}: the 'streamed' variant serves it")
    return None


def _registers(kind: str, dtype: torch.dtype, columns: int, acc: str, prefetch: bool = False) -> int:
    """Registers a thread needs: x, dy and weight of its columns (and the next row's x and dy,
    and the fused kinds' dresidual_sum, with ``prefetch``), their sums where ``acc`` is
    "register" (the streamed mode's columns: those of one step)."""
    arrays = (6 if kind.startswith("add_") else 5) if prefetch else 3  # the fused kinds' row of dresidual_sum
    held = math.ceil(arrays * columns * dtype.itemsize / 4)
    return held + (columns * parts_of(kind) if acc == "register" else 0) + _REGISTERS_BESIDES_COLUMNS


def _prefetches(kind: str, dtype: torch.dtype, columns: int, threads: int, rows: int, acc: str) -> bool:
    """Whether the register mode loads a slot's next row ahead (and, for the fused kinds, the
    row's dresidual_sum before its reduction): where the buffers cost no block of the SM's
    register budget and, for the fused kinds at the default two vectors per thread, where a row
    fills its block (``rows`` slots per block: 1). A slot otherwise waits for each row's loads
    after writing the last one's dx, so its SM has no loads in flight while it reduces.

    H200, bf16, % of the copy bandwidth without -> with: rms_norm 72 -> 87 on 8192 x 4096,
    75 -> 89 on 32768 x 2048; add_rms_norm 76 -> 84 on 8192 x 4096, 65 -> 81 on 16384 x 7168,
    51 -> 61 on 4096 x 5120; add_layer_norm 59 -> 69 on 16384 x 7168. Where the buffers took a
    block they lost: layer_norm 64 -> 44 on 8192 x 4096 (its two column sums in registers),
    add_layer_norm 72 -> 60 there. The fused kinds with several slots per block of two vectors
    each lost too, though the registers estimate kept their blocks (add_rms_norm 78 -> 74 on
    32768 x 2048, 64 -> 56 on 16384 x 1024; not understood: rms_norm gained on the same blocks,
    and the fused kinds at one or four vectors per thread, ``_fused_vectors``, gain)."""
    if kind.startswith("add_") and rows > 1:
        return False
    return _prefetch_keeps_blocks(kind, dtype, columns, threads, acc)


def _prefetch_keeps_blocks(kind: str, dtype: torch.dtype, columns: int, threads: int, acc: str) -> bool:
    """Whether the registers estimate fits as many blocks per SM with the next row's buffers as
    without them."""
    fit = [REGISTER_FILE // (threads * _registers(kind, dtype, columns, acc, prefetch)) for prefetch in (False, True)]
    return fit[1] >= fit[0]


def _fused_vectors(kind: str, n: int, dtype: torch.dtype) -> dict | None:
    """The fused kinds' register-mode configuration, or None where no candidate qualifies (long
    rows: then the default two vectors): of one, two or four 16-byte vectors per thread, the count that
    leaves the fewest lanes idle (threads x vectors past the row's vectors) with at most
    ``BLOCK_THREADS`` threads a row and the column sums in registers, the fewer vectors on a
    tie; the next row prefetched, for add_rms_norm always, for add_layer_norm where the registers
    estimate keeps the blocks (``_prefetch_keeps_blocks``).

    Why, measured (% of the copy bandwidth, default two vectors -> this rule): H200 bf16,
    add_rms_norm 32768 x 2048 78 -> 87, 16384 x 1024 64 -> 76, 65536 x 768 59 -> 80, 4096 x 5120
    61 -> 63; add_layer_norm 32768 x 2048 76 -> 85, 16384 x 1024 55 -> 72. H100 fp16 on rows the
    first table did not hold: add_rms_norm 16384 x 1536 71 -> 86, 8192 x 2560 83 -> 85, 8192 x
    3072 88 -> 91, 16384 x 896 67 -> 73; add_layer_norm 16384 x 1536 68 -> 72, 16384 x 896 57 ->
    69; the best configuration measured on each of those rows. A lane with no vector idles
    through the row's loads; more threads than 256 a row, or column sums in shared memory, cost
    more than the idle lanes (add_layer_norm at four vectors, its two sums in shared memory:
    38-45 %). Prefetch lost for add_layer_norm where the estimate said it costs a block (8192 x
    2560 64 -> 59, 8192 x 3072 69 -> 64, H100 fp16) and won for add_rms_norm where it said so too
    (16384 x 1536 at four vectors 67 -> 86, H100 fp16), whose one column sum leaves it more
    registers (the estimate's count for it is not checked against ptxas). The unfused kinds do
    not follow the rule (rms_norm on the H200, bf16: 65536 x 768 at four vectors 58 % against
    72 at two, 32768 x 2048 at one 85 against 89): idle lanes are not the whole story, and the
    rule is the fused kinds' alone until a model explains both."""

    row_vectors = max(1, n * dtype.itemsize // VECTOR_BYTES)
    best, best_key = None, None
    for vectors in (1, 2, 4):
        config = launch_config(kind, "register", n, dtype, vectors=vectors)
        threads = config["tpr"]
        if threads > BLOCK_THREADS or config["acc"] != "register":
            continue
        key = (threads * config["unroll"] - row_vectors, vectors)
        if best_key is None or key < best_key:
            columns = config["unroll"] * config["vec"]
            keeps = _prefetch_keeps_blocks(kind, dtype, columns, threads * config["rows"], "register")
            best, best_key = {**config, "prefetch": kind == "add_rms_norm" or keeps}, key
    return best


def _sums_bytes(kind: str, columns: int, threads: int) -> int:
    """Bytes of float32 column sums (each part) for ``columns`` a thread of ``threads``."""
    return parts_of(kind) * columns * threads * 4


def _accumulators(kind: str, dtype: torch.dtype, columns: int, threads: int) -> str | None:
    """Where the register mode keeps its column sums: in registers when a block's registers fit
    half the register file (two blocks per SM, one loading while the other reduces), else in
    shared memory when they fit it and the rest of the registers fit the file; None: neither."""
    if threads * _registers(kind, dtype, columns, "register") <= REGISTER_FILE // 2:
        return "register"
    fits_shared = _sums_bytes(kind, columns, threads) <= _SHARED_ACCUMULATOR_BYTES
    if fits_shared and threads * _registers(kind, dtype, columns, "shared") <= REGISTER_FILE:
        return "shared"
    return None


def launch_config(
    kind: str, variant: str, n: int, dtype: torch.dtype, vectors: int | None = None, shared_per_block: int | None = None
) -> dict:
    """The row kernel's launch configuration: vec (elements per access), tpr (threads per row,
    a power of two), rows (row slots per block), mode, acc (register mode: where the column sums
    live), unroll (vectors per thread: all of them in the register mode, those in flight per step
    in the streamed one), prefetch (register mode: the next row loaded ahead). ``vectors``: the
    register mode's vectors per thread where the row has enough of them for 1024 threads; None:
    the fused kinds' rule (``_fused_vectors``) where it has a configuration, else two (as the
    forward's rms_norm). ``shared_per_block``: the shared memory a block may have on the GPU
    (None: not known, taken as enough); the streamed mode's column sums go to global memory where
    a block's would not fit it (the register mode's are ``refusal``'s to judge)."""
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}: expected one of {KINDS}")
    vec = 1 if variant == "scalar" else VECTOR_BYTES // dtype.itemsize
    nv = max(1, n // vec)
    if variant == "register":
        if vectors is None and kind.startswith("add_"):
            fused = _fused_vectors(kind, n, dtype)
            if fused is not None:
                return fused
        # `vectors` per thread, as many threads as that takes (up to 1024), then more vectors.
        tpr = min(pow2_ceil(math.ceil(nv / (vectors or 2))), MAX_THREADS)
        per_thread = math.ceil(nv / tpr)
        rows = max(1, BLOCK_THREADS // tpr)
        acc, prefetch = None, False
        if per_thread <= _MAX_VECTORS_PER_THREAD:
            acc = _accumulators(kind, dtype, per_thread * vec, tpr * rows)
            prefetch = acc is not None and _prefetches(kind, dtype, per_thread * vec, tpr * rows, rows, acc)
        return {"vec": vec, "tpr": tpr, "rows": rows, "mode": "register", "acc": acc, "unroll": per_thread,
                "prefetch": prefetch}
    unroll = 4
    tpr = min(pow2_ceil(math.ceil(nv / unroll)), MAX_THREADS)
    config = {"vec": vec, "tpr": tpr, "rows": max(1, BLOCK_THREADS // tpr), "mode": "streamed", "acc": "shared",
              "unroll": unroll}
    if shared_sum_bytes(kind, n, config) > _SHARED_ACCUMULATOR_BYTES or (
        shared_per_block is not None and block_shared_bytes(kind, n, config) > shared_per_block
    ):
        config["acc"] = "global"
    return config


def block_shared_bytes(kind: str, n: int, config: dict) -> int:
    """The shared memory a block of the row kernel takes: its column sums where ``acc`` is
    "shared" (``shared_sum_bytes``) and its reduction's float32 partials, one per part and warp
    of each row."""
    scratch = parts_of(kind) * config["rows"] * max(1, config["tpr"] // 32) * 4
    return scratch + (shared_sum_bytes(kind, n, config) if config["acc"] == "shared" else 0)


def shared_sum_bytes(kind: str, n: int, config: dict) -> int:
    """The shared memory a block's column sums take where ``acc`` is "shared": float32 sums of
    every vector its threads hold (the streamed mode: of every step).

    Why the streamed mode keeps them there: adding each row's sums into a partial row in global
    memory reads and writes 8 bytes a column and part at every row, more than the row's own
    6 bytes of dy, x and dx in 16-bit types, all of it through L2. H100, bf16, one slot an SM:
    layer_norm's streamed kernel ran at 31 % of the copy bandwidth on 16384 x 16384, rms_norm's
    (one part) at 75 %."""
    steps = 1 if config["mode"] == "register" else math.ceil(n // config["vec"] / (config["tpr"] * config["unroll"]))
    return _sums_bytes(kind, steps * config["unroll"] * config["vec"], config["tpr"] * config["rows"])


def blocks_per_sm(kind: str, n: int, dtype: torch.dtype, config: dict) -> int:
    """Blocks of the row kernel an SM holds at once, from its thread and register budget and,
    where the column sums are in shared memory, its shared-memory budget. The streamed mode's
    thread holds the vectors of one step (``unroll``) of x, dy and weight: ptxas for sm_90 gave
    its 512-thread blocks 96 (layer_norm) and 128 (rms_norm) registers a thread at 16384 bf16
    columns, one block an SM, which the estimate finds (112); counting threads alone said four.

    Why it matters: the slots (``partial_rows``) follow it. H100, bf16, the streamed kernel with
    the slots the thread count gave (187-528) against one an SM (us): layer_norm 4096 x 12288 389 -> 331, 8192 x 9216 495 -> 469,
    16384 x 16384 1701 -> 1689; rms_norm 4096 x 12288 148 -> 135, 8192 x 9216 222 -> 210;
    add_rms_norm 4096 x 12288 174 -> 160, 16384 x 16384 845 -> 824. Blocks past the resident
    ones wait for a whole wave, and each slot's partial row is read and written at every row it
    walks: fewer slots keep those rows in L2. A slot short of the blocks an SM holds costs more
    (half the slots: layer_norm 16384 x 16384 1689 -> 2271 us), so the element-wise mode (vec 1)
    counts threads alone: its thread holds a few elements, the estimate's fixed part dominates
    and undercounts (ptxas: 48-56 registers, four 256-thread blocks an SM; the estimate three)."""
    threads, columns = config["tpr"] * config["rows"], config["unroll"] * config["vec"]
    fit = THREADS_PER_SM // threads
    if config["vec"] > 1:
        registers = _registers(kind, dtype, columns, config["acc"], config.get("prefetch", False))
        fit = min(fit, REGISTER_FILE // (threads * registers))
    if config["acc"] == "shared":
        fit = min(fit, 2 * _SHARED_ACCUMULATOR_BYTES // shared_sum_bytes(kind, n, config))
    return max(1, fit)


def partial_rows(kind: str, m: int, n: int, dtype: torch.dtype, config: dict, sm_count: int) -> int:
    """S, the row slots (rows of partial sums) of a call of m rows: as many blocks as the SMs
    hold at once, fewer where the partials would outweigh the rows (``_PARTIAL_TRAFFIC_SHARE``)
    but at least one per SM (and none without a row);
    a multiple of the slots per block, so that every slot of every block is a real one."""
    rows_moved_bytes = 3 * n * dtype.itemsize  # dy and x read, dx written, per row
    partial_bytes = 8 * parts_of(kind) * n
    min_rows_per_slot = max(1, math.ceil(_PARTIAL_TRAFFIC_SHARE * partial_bytes / rows_moved_bytes))
    per_block = config["rows"]
    resident = sm_count * blocks_per_sm(kind, n, dtype, config)
    # ... but never fewer blocks than SMs where the rows allow: an SM without one idles its share
    # of the bandwidth (H200, 2048 x 4096 fp16 layer_norm: 94 slots of 22 rows left 38 SMs idle).
    blocks = min(resident, max(sm_count, math.ceil(m / (per_block * min_rows_per_slot))), math.ceil(m / per_block))
    return max(1, blocks) * per_block
