"""The cross-entropy kernels' launch rules, from the hardware facts and the row length.

The rows step is a row reduction that streams each row once. What matters is 16-byte accesses,
enough of them in flight per SM (each thread loads ``UNROLL`` accesses before folding them in),
and enough blocks to reach every SM:

- ``threads``: the fewest threads (a power of two, 32 to 512) that take a row's accesses in one
  unrolled step, so that a short row (V of a few thousand) does not idle most of a wide block,
  and 512 for long rows (a vocabulary of 32k and more), whose blocks loop over the row;
- ``splits``: how many blocks share one row. With many rows one block per row fills the GPU;
  with fewer rows than ``FILL_BLOCKS_PER_SM`` blocks per SM, each row is split into spans so
  that rows x splits reaches that many blocks, but never into spans shorter than one unrolled
  step of the block. Since the split count is a compile-time constant, the kernel has one build
  per row-count tier (``ROW_TIERS``, each serving calls of at most that many rows), the main build
  (one split) serving the rest.

The fused step (a reduced loss's training step: both passes over a row in one block) takes the
rows step's main build, and where the rows its blocks hold at once would not fit in L2 together,
half as many rows in blocks of twice the threads, the second pass reading each row from its end
(``fused_config``).

The grad step is elementwise: 256 threads of 4 accesses each per block, one grid row per logits
row. Rows that are not whole 16-byte accesses in aligned tensors (an odd V) take the shifted
programs in both steps: 16-byte accesses over each row's aligned middle, its ends element by
element (``row_layout``); only a misaligned data pointer leaves one element per access.

These rules were written from the H200's facts (132 SMs, 16-byte accesses). Timed against their
tuning candidates on an H100 (bf16, 1024-8192 rows of 30522-128256): the grad step's default was
within 1 % of the best candidate everywhere, and the rows step's within 2.5 % but at 4096 x 50257
(152.8 us; 256 threads 146.1, which lost at 1024 x 128256 and 8192 x 32768). ``rows_candidates``
and ``grad_candidates`` (and ``tier_candidates`` on a call a split build serves) are what
``request_tune`` times.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from tileops.core import DeviceFacts

from ..device import rows_fit_l2
from ..powers import pow2_ceil
from ..row_layout import shifts, vector_width

#: The dtypes the TileLang kernels take (float64 is served by plain torch).
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: The target dtypes they take.
TARGET_DTYPES = (torch.int64, torch.int32)
#: Accesses each thread of the rows step loads before it folds them in.
UNROLL = 4
MAX_THREADS = 512
#: The fused step's threads where a row's second read would miss L2 (``fused_config``).
MAX_FUSED_THREADS = 1024
#: Blocks per SM the rows step aims at when rows are few.
FILL_BLOCKS_PER_SM = 2
#: Row counts at or below which a split build serves a call.
ROW_TIERS = (1, 4, 16, 64)
GRAD = {"threads": 256, "per_thread": 4}
#: The scale step: elementwise, as the grad step, in a grid of ``SCALE_BLOCKS_PER_SM`` blocks
#: per SM that stride over the gradient.
SCALE = {"threads": 256, "per_thread": 4}
SCALE_BLOCKS_PER_SM = 8  # 2048 threads: an SM's most


def refusal(dtype: torch.dtype, target_dtype: torch.dtype) -> str | None:
    if dtype not in DTYPES:
        return f"takes float16, bfloat16 and float32 logits, not {dtype}"
    if target_dtype not in TARGET_DTYPES:
        return f"takes int64 and int32 target_ids, not {target_dtype}"
    return None


def access_layout(dtype: torch.dtype, vocab: int, aligned: bool, pointers_aligned: bool) -> dict[str, Any]:
    """The programs' ``vec`` (and ``shifted``, for rows that are not whole accesses in aligned
    tensors) for a call of this alignment."""
    if shifts(vocab, dtype, aligned, pointers_aligned):
        return {"vec": vector_width(dtype, True), "shifted": True}
    return {"vec": vector_width(dtype, aligned)}


def rows_config(dtype: torch.dtype, vocab: int, aligned: bool, pointers_aligned: bool = False) -> dict[str, Any]:
    """The main build of the rows step: one block per row (at least 32 threads: a shifted row's
    first ``2 * vec`` read its edges)."""
    layout = access_layout(dtype, vocab, aligned, pointers_aligned)
    accesses = vocab // layout["vec"]
    threads = min(MAX_THREADS, max(32, pow2_ceil(math.ceil(accesses / UNROLL))))
    return {**layout, "threads": threads, "unroll": UNROLL, "splits": 1}


def split_count(config: dict[str, Any], vocab: int, rows: int, sm_count: int) -> int:
    """How many blocks share each of ``rows`` rows so that the call fills the GPU."""
    accesses = vocab // config["vec"]
    per_block = config["threads"] * config["unroll"]
    wanted = math.ceil(FILL_BLOCKS_PER_SM * sm_count / rows)
    return max(1, min(wanted, accesses // per_block))


def row_tiers(config: dict[str, Any], vocab: int, sm_count: int) -> list[tuple[int, dict[str, Any]]]:
    """(rows, configuration) of the split builds: the tiers whose split count exceeds one."""
    tiers = []
    for rows in ROW_TIERS:
        splits = split_count(config, vocab, rows, sm_count)
        if splits > 1:
            tiers.append((rows, {**config, "splits": splits}))
    return tiers


def tier_candidates(tier: dict[str, Any], vocab: int) -> list[dict[str, Any]]:
    """Configurations of a split build worth timing, ``tier`` first: half and twice its splits
    with half, the same and twice its threads, within the rule's limits (32 to ``MAX_THREADS``
    threads, at least two spans a row, none shorter than one unrolled step of the block). The
    rule aims at a fill of the GPU it has not measured."""
    accesses = vocab // tier["vec"]
    candidates = [tier]
    for threads in (tier["threads"] // 2, tier["threads"], tier["threads"] * 2):
        if not 32 <= threads <= MAX_THREADS:
            continue
        most = accesses // (threads * tier["unroll"])
        for splits in (tier["splits"] // 2, tier["splits"], tier["splits"] * 2):
            candidate = {**tier, "threads": threads, "splits": splits}
            if 2 <= splits <= most and candidate not in candidates:
                candidates.append(candidate)
    return candidates


def rows_candidates(dtype: torch.dtype, vocab: int, aligned: bool, pointers_aligned: bool = False) -> list[dict[str, Any]]:
    """Main-build configurations of the rows step worth timing, the default first."""
    default = rows_config(dtype, vocab, aligned, pointers_aligned)
    shapes = [(default["threads"], UNROLL), (256, UNROLL), (1024, 2), (512, 8)]
    seen, candidates = set(), []
    for threads, unroll in shapes:
        if (threads, unroll) not in seen:
            seen.add((threads, unroll))
            candidates.append({**default, "threads": threads, "unroll": unroll})
    return candidates


def grad_config(dtype: torch.dtype, vocab: int, aligned: bool, pointers_aligned: bool = False) -> dict[str, Any]:
    return {**access_layout(dtype, vocab, aligned, pointers_aligned), **GRAD}


def grad_candidates(dtype: torch.dtype, vocab: int, aligned: bool, pointers_aligned: bool = False) -> list[dict[str, Any]]:
    layout = access_layout(dtype, vocab, aligned, pointers_aligned)
    shapes = (GRAD, {"threads": 128, "per_thread": 4}, {"threads": 512, "per_thread": 2}, {"threads": 256, "per_thread": 8})
    return [{**layout, **shape} for shape in shapes]


def fused_config(
    dtype: torch.dtype, vocab: int, aligned: bool, pointers_aligned: bool = False, facts: DeviceFacts | None = None
) -> dict[str, Any]:
    """The fused step's configuration: the rows step's main build (one block per row), whose
    threads and unroll it shares, while the rows its blocks hold at once (two 512-thread blocks
    per SM) fit in the L2 of the device with ``facts``: each row's second read is then served
    from L2. Where they do not, one block of ``MAX_FUSED_THREADS`` per SM halves the rows in
    flight (each thread keeping ``UNROLL`` accesses in flight, as many a SM as before), and the
    second pass reads each row from its end, where the first pass left it in L2.

    Measured on an H100 (50 MiB of L2, bf16, the fused program alone by graph replay), 512 x 4
    forward -> 1024 x 4 from the end: 4096 x 128256 1039 -> 914 us, 2048 x 151936 624 -> 559,
    3000 x 100000 588 -> 505, 2048 x 202048 844 -> 777, 1024 x 256000 530 -> 499 (a copy of the
    logits 690, 510, 492, 545, 346); on rows that fit, 1024 threads lost (4096 x 50257 351 ->
    364, 8192 x 32000 369 -> 448) and reading from the end alone gained nothing everywhere (8192
    x 32000 369 -> 385, 2048 x 30522 98.4 -> 99.0, 4096 x 50257 351 -> 340). Earlier, 512 x 4
    against 256 x 4, 512 x 2, 1024 x 2 and 1024 x 1 (all reading forwards): best or within 4 %
    on rows of 30001-50257 (2048 x 30522: 98.2 us, the rows and grad steps apart 148.7).

    The program's loads carry eviction priorities where the device has them (pass 1 "evict
    last", pass 2 "evict first"), which moved the numbers above (H100, both builds of the rule):
    4096 x 128256 914 -> 767 us, 2048 x 151936 559 -> 489, 3000 x 100000 503 -> 468, 4096 x
    50257 351 -> 315, 8192 x 32000 369 -> 350; with them the rule's choice stayed the faster of
    the two on every shape but 6000 x 65536, where both took 573-576 us."""
    config = rows_config(dtype, vocab, aligned, pointers_aligned)
    fused = {key: config[key] for key in ("vec", "threads", "unroll", *(("shifted",) if "shifted" in config else ()))}
    if config["threads"] == MAX_THREADS and not _resident_rows_fit_l2(vocab * dtype.itemsize, facts):
        fused.update(threads=MAX_FUSED_THREADS, from_end=True)
    return fused


def fused_candidates(
    default: dict[str, Any], dtype: torch.dtype, vocab: int, aligned: bool, pointers_aligned: bool = False
) -> list[dict[str, Any]]:
    """Fused-step configurations worth timing, ``default`` first: the rows step's shapes and
    one 1024-thread block per SM, each reading the second pass in the default's direction, and
    the default in the other direction."""
    shapes = [(c["threads"], c["unroll"]) for c in rows_candidates(dtype, vocab, aligned, pointers_aligned)]
    shapes.append((MAX_FUSED_THREADS, UNROLL))
    candidates = [default]
    for threads, unroll in shapes:
        candidate = {**default, "threads": threads, "unroll": unroll}
        if candidate not in candidates:
            candidates.append(candidate)
    candidates.append({**default, "from_end": not default.get("from_end", False)})
    return candidates


def _resident_rows_fit_l2(row_bytes: int, facts: DeviceFacts | None) -> bool:
    """Whether the rows of the 512-thread blocks a device runs at once (two per SM: the fused
    program asks ptxas for that) fit in its L2 together; True where the facts do not say, so
    that the rule keeps the rows step's build."""
    return rows_fit_l2(facts, MAX_FUSED_THREADS // MAX_THREADS, row_bytes) is not False


def scale_config(dtype: torch.dtype, aligned: bool, sm_count: int) -> dict[str, Any]:
    return {"vec": vector_width(dtype, aligned), **SCALE, "blocks": SCALE_BLOCKS_PER_SM * sm_count}
