"""The attention kernels' launch rules, from the hardware facts of Hopper.

Flash attention is compute-bound: what matters is that every product is a wgmma over tiles the
tensor cores take whole, that the next K and V tiles load (TMA) while the current ones are
multiplied, and that the float32 accumulators fit the registers without spilling.

- A wgmma's M is 64 rows per warpgroup; a forward block has two or three consumer warpgroups
  (TileLang adds a producer warpgroup for the loads), each taking 64 query rows: ``block_m`` =
  64 per consumer warpgroup.
- Registers: a consumer thread holds its warpgroup's share of O (64 * D float32 over 128 threads,
  D / 2 registers), of S (block_n / 2) and of P (16-bit pairs, block_n / 4). With two consumers
  a thread may take 240 registers, which fit D = 128 with block_n = 128 and D = 256 with block_n
  = 64; with three (four warpgroups in the SM's 64K registers) 160. Three consumers keep the
  tensor cores busier while one warpgroup is in its softmax, where their accumulators leave 32
  of those 160 for addresses and statistics: D = 64 (32 + 64 + 32). H100, bf16, 32/8
  heads, forward kernel alone: D 64 at 4 x 2048, causal 264.0 -> 257.4 us, full 422.9 -> 380.3
  us; D 128 (no room left: 64 + 64 + 32) causal 1261.3 -> 1216.0 us but full 1016.3 -> 1127.7.
- The products of a forward step stay synchronous: a schedule that issues block kb's S = Q K^T
  and block kb - 1's P V asynchronously and computes kb's softmax while P V runs (one step more
  than blocks, each with two waits) was slower on an H100, bf16, 32/8 heads, same outputs: D 64
  at 4 x 2048 causal 254.7 -> 292.6 us, D 128 at 2 x 4096 causal 594.2 -> 748.4 us and full
  1021.4 -> 1257.7 us, D 256 causal 116.8 -> 151.0 us. In that form (the first and last steps'
  products issued conditionally, o rescaled between S's issue and its wait) ptxas serialised
  the products and inserted a wait (its C7514 and C7517 notes in a verbose build); a form
  without either compiles clean and has not been timed.
- Shared memory: Q (block_m * D) plus ``stages`` buffers of K and V (2 * block_n * D each), in
  2-byte elements, within the 227 KiB a block may use (228 KiB per SM, 1 KiB reserved); stages
  is the deepest of 2 and 1 that fits (2 for every head size served).
- Backward, per key block: K and V (block_n rows), dK and dV float32 in registers (2 * block_n * D
  over 256 threads: block_n = 128 up to D = 128, 64 for D = 256), ``block_m`` = 64 query rows per
  step (Q and dO tiles ``stages`` deep, the dS^T tile, and P^T's where split: counted always).
  A key block of fewer than 128 rows cannot give each warpgroup 64 rows, so its accumulators
  are split by columns (``split_columns``).

Head sizes 64, 128 and 256 are served (others by plain torch), bfloat16 and float16. The
forward's rules were written from these facts; ``forward_candidates`` are what ``request_tune``
times. The dense backward's schedule (``dense_backward_config``) was measured on an H100 against
torch's flash backward in the same run.
"""

from __future__ import annotations

from typing import Any

import torch

#: The dtypes and head sizes the TileLang kernels take.
DTYPES = (torch.float16, torch.bfloat16)
HEAD_DIMS = (64, 128, 256)
#: The shared memory one block may use on Hopper: 228 KiB per SM, 1 KiB of it reserved per block.
SMEM_BYTES = 227 * 1024
_ELEMENT = 2  # bytes of a float16 or bfloat16 element
_WARPGROUP = 128  # threads
_THREADS = 2 * _WARPGROUP  # two consumer warpgroups
#: A wgmma's M per warpgroup: the rows of a tile one warpgroup multiplies.
WGMMA_ROWS = 64
#: The row kernels of the backward (delta, the dQ cast): 64 rows per block over 256 threads, so
#: that a (64, 256) float32 tile is 64 registers a thread and two of them fit without spilling.
ROWS_KERNEL = {"block_m": 64, "threads": 256}


def refusal(dtype: torch.dtype, head_dim: int) -> str | None:
    if dtype not in DTYPES:
        return f"takes float16 and bfloat16, not {dtype}"
    if head_dim not in HEAD_DIMS:
        return f"takes head sizes {', '.join(map(str, HEAD_DIMS))}, not {head_dim}"
    return None


def _stages(fixed: int, per_stage: int) -> int:
    """The deepest of 2 and 1 pipeline stages whose shared memory fits."""
    return 2 if fixed + 2 * per_stage <= SMEM_BYTES else 1


#: A consumer thread's registers beside the producer warpgroup's, by consumer warpgroups: TileLang
#: gives two consumers 240 each, three 160 (and the producer 24) of the SM's 64512.
_CONSUMER_REGISTERS = {2: 240, 3: 160}
#: Registers a forward consumer thread needs beside its accumulators (addresses, statistics).
_SPARE_REGISTERS = 32


def _consumer_registers(head_dim: int, block_n: int) -> int:
    """Registers a forward consumer thread's O, S and P take (float32 O and S, 16-bit P)."""
    per_thread = WGMMA_ROWS / _WARPGROUP
    return int(per_thread * head_dim + per_thread * block_n + per_thread * block_n / 2)


def _fits(consumers: int, head_dim: int, block_n: int) -> bool:
    """Whether ``consumers`` warpgroups' accumulators and spare registers fit a consumer thread."""
    return _consumer_registers(head_dim, block_n) + _SPARE_REGISTERS <= _CONSUMER_REGISTERS[consumers]


def forward_config(head_dim: int) -> dict[str, Any]:
    block_n = 128 if head_dim <= 128 else 64
    consumers = 3 if _fits(3, head_dim, block_n) else 2
    block_m = consumers * WGMMA_ROWS
    stages = _stages(block_m * head_dim * _ELEMENT, 2 * block_n * head_dim * _ELEMENT)
    return {"block_m": block_m, "block_n": block_n, "stages": stages, "threads": consumers * _WARPGROUP}


#: A key tile's rows are the k of the P V product, a multiple of 16 for a 16-bit wgmma.
_KEY_TILE_STEP = 16
#: A wgmma's widest N: the most keys one S = Q K^T product covers.
_WGMMA_MAX_N = 256


def widest_key_tile(consumers: int, head_dim: int) -> int:
    """The widest key tile a forward block of ``consumers`` warpgroups takes: its S and P fit a
    consumer thread's registers beside O with the spare ones, and its K and V tiles fit shared
    memory two stages deep beside Q. D = 128 (two consumers): 192 keys, by the registers; D =
    256: 80, by shared memory; D = 64 (three consumers): 128, by the registers. A wider tile
    takes fewer row maxima and rescales of O per key, and masks more columns where it straddles
    a causal diagonal."""
    block_m = consumers * WGMMA_ROWS
    for block_n in range(_WGMMA_MAX_N, 0, -_KEY_TILE_STEP):
        two_stages = _stages(block_m * head_dim * _ELEMENT, 2 * block_n * head_dim * _ELEMENT) == 2
        if two_stages and _fits(consumers, head_dim, block_n):
            return block_n
    return _KEY_TILE_STEP


def forward_candidates(head_dim: int) -> list[dict[str, Any]]:
    """Forward configurations worth timing, the rules' first: one stage less, half-width and the
    widest key tiles (``widest_key_tile``), and the other count of consumer warpgroups (two or
    three)."""
    default = forward_config(head_dim)
    candidates = [default, {**default, "stages": 1}]
    if default["block_n"] > 64:
        candidates.append({**default, "block_n": default["block_n"] // 2})
    widest = widest_key_tile(default["threads"] // _WARPGROUP, head_dim)
    if widest > default["block_n"]:
        candidates.append({**default, "block_n": widest})
    other = 2 if default["threads"] == 3 * _WARPGROUP else 3
    if _fits(other, head_dim, default["block_n"]):
        candidates.append({**default, "block_m": other * WGMMA_ROWS, "threads": other * _WARPGROUP})
    return candidates


def _backward_shared(block_n: int, block_m: int, head_dim: int) -> tuple[int, int]:
    """(fixed, per stage) shared memory of the backward's main kernel: the key block's K and V,
    its P^T and dS^T tiles and the output tile; a query block's Q and dO per stage. The output
    tile is written after the loop, in memory TileLang shares with the loop's tiles, so its
    float32 form (dK and dV added into accumulators) needs no more: D = 128 at 32/8 heads with
    dQ's float32 tile would not fit otherwise, and it compiles and runs."""
    fixed = (2 * block_n * head_dim + 2 * block_n * block_m + block_n * head_dim) * _ELEMENT
    return fixed, 2 * block_m * head_dim * _ELEMENT


def backward_config(head_dim: int) -> dict[str, Any]:
    block_n = 128 if head_dim <= 128 else 64
    block_m = WGMMA_ROWS
    stages = _stages(*_backward_shared(block_n, block_m, head_dim))
    split = block_n < 2 * WGMMA_ROWS
    return {"block_n": block_n, "block_m": block_m, "stages": stages, "threads": _THREADS, "split_columns": split}


def dense_backward_config(head_dim: int) -> dict[str, Any]:
    """``backward_config`` with the dense backward's schedule: the products issued asynchronously
    (``overlap``), one block per query head (``per_query_head``: 4x the blocks of a 32/8-head
    call, so the causal triangle's long and short key blocks spread over the SMs), and each
    step's dQ added by one TMA reduce-add from shared memory (``dq_by_tma``) where its float32
    tile fits beside the pipeline's. H100, bf16, causal, 32/8 heads, backward main kernel with
    its zeroing, against torch SDPA's flash backward (all of it) in the same run: D = 64 (4 x
    2048) 1242 -> 1062 (overlap, per head) -> 848 us (dQ by TMA), flash 809; D = 128 (4 x
    4096) 6136 -> 5677 -> 3955 us, flash 4933. dQ's atomics were the step's longest wait."""
    config = {**backward_config(head_dim), "overlap": True, "per_query_head": True}
    fixed, per_stage = _backward_shared(config["block_n"], config["block_m"], head_dim)
    dq_tile = config["block_m"] * head_dim * 4
    return {**config, "dq_by_tma": fixed + config["stages"] * per_stage + dq_tile <= SMEM_BYTES}
