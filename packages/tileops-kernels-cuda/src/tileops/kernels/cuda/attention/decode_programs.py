"""The TileLang programs of decode attention (split-KV flash decoding), and their compilation.

``make_attend_program`` is the main kernel. One block serves one (kv head, sequence, split): the
rows of its small GEMMs are every query head of the kv head's group times every new token
(G * S rows, G = Hq / Hkv, padded to ``block_m``, a multiple of the 16 rows of an MMA), and it
walks its slice of the sequence's cache ``block_n`` positions at a time: scores = Q K^T in
float32, an online softmax in base 2 (the scale times log2(e) folded into one multiply), and
O += P V with P rounded to the inputs' dtype. The sequence's length is read on the device from
``cache_seqlens`` (clamped to the cache's capacity), and the slices are cut from it: split
``sp`` of ``NS`` takes the ``sp``-th share of the length's tiles, so a split past the length
runs no tile and writes an empty result; nothing about the lengths is known when the program
is launched, which is what lets a captured graph replay with other lengths.

The memory past a sequence's length is whatever the caller's cache holds there (torch.empty
garbage, NaN included), and a NaN value times a zero weight would still be NaN. Tiles are loaded
one of two ways. Pipelined (``stages`` > 0): a tile of keys and one of values are copied whole
(TMA on sm_90) in a software pipeline, the next tiles' copies in flight while one is computed;
scores past the length are masked, and the sequence's last tile has its values past the length
zeroed in shared memory. Guarded: element by element, zeros written for positions not held, and
a paged cache read row by row through the block table (row p of sequence b: page
``block_table[b, p // page]``, row ``p % page``), which serves every page size, smaller than a
tile or larger. A key mask, or pages smaller than a tile, take the guarded loads. The cache layout
(``bshd``: a position's kv heads side by side; ``bhsd``: a kv head's positions side by side, as
transformers' caches) only changes the index of a cache element: a block reads one kv head's
rows of D contiguous elements either way. With a key mask (``masked``), a position is held (loaded,
and scored) only where it is also shown by ``key_mask[b, p]`` (p < KP): a mask hides a padded
batch's positions, and what the cache holds there is not read, as past the length.

With ``split`` the block writes its partial output and base-2 log-sum-exp in float32 to
``o_part`` (NS, B, S, Hq, D) and ``lse_part`` (NS, B, Hq, S), and ``make_merge_program``
combines the splits (one block per output row, one thread per column); without, it writes ``o``
in the inputs' dtype and the natural ``lse`` itself. A row that sees no position gets o = 0 and
lse = -inf. The batch, the caches' rows and length, the block table's width and the split count
are symbolic, so one compiled program serves every decode step; the heads, the head size, the
new-token count, the page size, the scale, causality and the tiling are compile-time constants.
Importing this module does not import tilelang; building a program does.
"""

# No `from __future__ import annotations`: TileLang evaluates the prim_func's annotations.

import math

import torch

from ..compile import compile_once
from ..device import hopper_target

from .decode_policy import block_rows

_TL_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16"}
_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)


def make_attend_program(
    dtype: torch.dtype,
    heads_q: int,
    heads_kv: int,
    head_dim: int,
    new_tokens: int,
    page_size: int,
    scale: float,
    causal: bool,
    cache_layout: str,
    masked: bool,
    *,
    split: bool,
    block_n: int,
    threads: int,
    blocks_per_sm: int,
    stages: int,
):
    """The TileLang PrimFunc ``main(q, k_cache, v_cache, cache_seqlens[, block_table][, key_mask],
    outputs)`` of the module docstring: outputs ``o_part, lse_part`` with ``split``, else ``o,
    lse``. ``page_size`` 0 is a contiguous cache (no block table); ``masked`` takes a key mask;
    ``blocks_per_sm`` is how many blocks the compiler must fit on one multiprocessor (it bounds
    the registers of a thread); ``stages`` > 0 copies whole tiles in a pipeline of that many
    stages (``decode_policy.stages`` says which calls may), 0 loads them guarded."""
    if stages and (masked or page_size % block_n):
        raise ValueError(
            f"stages={stages}: tiles are copied whole only from caches without a key mask whose pages hold "
            f"whole tiles (page size {page_size}, tile {block_n}, masked={masked})"
        )

    import tilelang.language as T

    dt, f32 = _TL_DTYPES[dtype], "float32"
    group = heads_q // heads_kv
    rows = group * new_tokens
    block_m = block_rows(heads_q, heads_kv, new_tokens)
    paged = page_size > 0
    scale_log2 = float(scale) * _LOG2E
    dim = head_dim

    batch = T.dynamic("batch")
    cache_rows = T.dynamic("cache_rows")
    length_dim = page_size if paged else T.dynamic("cache_len")
    pages = T.dynamic("pages")
    mask_width = T.dynamic("mask_width")
    splits = T.dynamic("splits") if split else 1
    # The positions a sequence may hold; cache_seqlens is clamped to it.
    capacity = pages * page_size if paged else length_dim

    q_shape = (batch, new_tokens, heads_q, dim)
    heads_first = cache_layout == "bhsd"
    cache_shape = (cache_rows, heads_kv, length_dim, dim) if heads_first else (cache_rows, length_dim, heads_kv, dim)

    def element(cache, row, hk, position, d):
        # Row ``row`` of the caches (a sequence, or a page), position ``position`` within it: an
        # index expression, built in Python while the program is traced.
        if heads_first:
            return cache[row, hk, position, d]
        return cache[row, position, hk, d]

    def held(key_mask, b, p, length):
        # Whether position p of sequence b is read and scored: before the length, and shown by
        # the key mask where there is one (an index expression, built while tracing).
        if masked:
            # if_then_else evaluates the load only where it is in bounds (a mask of width 0 too).
            return (p < length) & T.if_then_else(p < mask_width, key_mask[b, p], False)
        return p < length

    @T.macro
    def load_tile(cache, shared, block_table, key_mask, b, hk, start, length):
        # Positions not held are written as zeros (see the module docstring).
        if paged:
            for j, d in T.Parallel(block_n, dim):
                p = start + j
                page = T.max(T.min(block_table[b, T.min(p // page_size, pages - 1)], cache_rows - 1), 0)
                shared[j, d] = T.if_then_else(
                    held(key_mask, b, p, length), element(cache, page, hk, p % page_size, d), T.cast(0, dt)
                )
        else:
            for j, d in T.Parallel(block_n, dim):
                p = start + j
                shared[j, d] = T.if_then_else(held(key_mask, b, p, length), element(cache, b, hk, p, d), T.cast(0, dt))

    @T.macro
    def attend(q_shared, k_shared, v_shared, p_shared, scores, acc, row_max, row_max_prev, row_shift, row_rescale,
               row_sum, total, key_mask, b, start, length):
        T.clear(scores)
        T.gemm(q_shared, k_shared, scores, transpose_B=True, policy=T.GemmWarpPolicy.FullCol)
        for r, j in T.Parallel(block_m, block_n):
            p = start + j
            if causal:
                # New token s sees up to position length - S + s (bottom-right aligned).
                scores[r, j] = T.if_then_else(
                    held(key_mask, b, p, length) & (p <= length - new_tokens + r // group),
                    scores[r, j] * scale_log2, -T.infinity(f32),
                )
            else:
                scores[r, j] = T.if_then_else(
                    held(key_mask, b, p, length), scores[r, j] * scale_log2, -T.infinity(f32)
                )
        T.copy(row_max, row_max_prev)
        T.reduce_max(scores, row_max, dim=1, clear=False)
        for r in T.Parallel(block_m):
            # A row that has seen nothing yet keeps max -inf: shift by 0 instead, so that
            # exp2(-inf - shift) is 0, not NaN.
            row_shift[r] = T.if_then_else(row_max[r] == -T.infinity(f32), 0, row_max[r])
            row_rescale[r] = T.exp2(row_max_prev[r] - row_shift[r])
        for r, j in T.Parallel(block_m, block_n):
            scores[r, j] = T.exp2(scores[r, j] - row_shift[r])
        T.reduce_sum(scores, row_sum, dim=1)
        for r in T.Parallel(block_m):
            total[r] = total[r] * row_rescale[r] + row_sum[r]
        for r, d in T.Parallel(block_m, dim):
            acc[r, d] *= row_rescale[r]
        T.copy(scores, p_shared)
        T.gemm(p_shared, v_shared, acc, policy=T.GemmWarpPolicy.FullCol)

    def tile_of(cache, block_table, b, hk, start):
        # The region of a tile of one kv head's positions from ``start``: in the sequence's row
        # of a contiguous cache, or in the page holding it (a page holds whole tiles).
        if paged:
            page = T.max(T.min(block_table[b, T.min(start // page_size, pages - 1)], cache_rows - 1), 0)
            row, offset = page, start % page_size
        else:
            row, offset = b, start
        if heads_first:
            return cache[row, hk, offset : offset + block_n, :]
        return cache[row, offset : offset + block_n, hk, :]

    @T.macro
    def body(q, k_cache, v_cache, cache_seqlens, block_table, key_mask, o_out, lse_out):
        with T.Kernel(splits, heads_kv, batch, threads=threads) as (sp, hk, b):
            # The registers a thread may use are held to what ``blocks_per_sm`` blocks leave it.
            T.annotate_min_blocks_per_sm(blocks_per_sm)
            q_shared = T.alloc_shared((block_m, dim), dt)
            k_shared = T.alloc_shared((block_n, dim), dt)
            v_shared = T.alloc_shared((block_n, dim), dt)
            p_shared = T.alloc_shared((block_m, block_n), dt)
            scores = T.alloc_fragment((block_m, block_n), f32)
            acc = T.alloc_fragment((block_m, dim), f32)
            row_max = T.alloc_fragment((block_m,), f32)
            row_max_prev = T.alloc_fragment((block_m,), f32)
            row_shift = T.alloc_fragment((block_m,), f32)
            row_rescale = T.alloc_fragment((block_m,), f32)
            row_sum = T.alloc_fragment((block_m,), f32)
            total = T.alloc_fragment((block_m,), f32)

            # Scalars computed once (kept in registers rather than re-derived in every index).
            length = T.alloc_var("int32")
            first = T.alloc_var("int32")
            count = T.alloc_var("int32")
            length = T.max(T.min(cache_seqlens[b], capacity), 0)
            first = sp * T.ceildiv(T.ceildiv(length, block_n), splits)
            count = T.max(T.min(T.ceildiv(T.ceildiv(length, block_n), splits), T.ceildiv(length, block_n) - first), 0)

            # Row r of the block is query head hk * G + r % G of new token r // G.
            for r, d in T.Parallel(block_m, dim):
                q_shared[r, d] = T.if_then_else(
                    r < rows, q[b, T.min(r // group, new_tokens - 1), hk * group + r % group, d], T.cast(0, dt)
                )
            T.fill(acc, 0)
            T.fill(total, 0)
            T.fill(row_max, -T.infinity(f32))

            if stages:
                for t in T.Pipelined(count, num_stages=stages):
                    start = (first + t) * block_n
                    T.copy(tile_of(k_cache, block_table, b, hk, start), k_shared)
                    T.copy(tile_of(v_cache, block_table, b, hk, start), v_shared)
                    if start + block_n > length:
                        # The sequence's last tile: rows past the length hold whatever the cache
                        # holds (NaN too), which a zero weight would not cancel.
                        for j, d in T.Parallel(block_n, dim):
                            v_shared[j, d] = T.if_then_else(start + j < length, v_shared[j, d], T.cast(0, dt))
                    attend(q_shared, k_shared, v_shared, p_shared, scores, acc, row_max, row_max_prev, row_shift,
                           row_rescale, row_sum, total, key_mask, b, start, length)
            else:
                for t in T.serial(count):
                    start = (first + t) * block_n
                    load_tile(k_cache, k_shared, block_table, key_mask, b, hk, start, length)
                    load_tile(v_cache, v_shared, block_table, key_mask, b, hk, start, length)
                    attend(q_shared, k_shared, v_shared, p_shared, scores, acc, row_max, row_max_prev, row_shift,
                           row_rescale, row_sum, total, key_mask, b, start, length)

            # A row with total 0 saw nothing: o = 0, lse = -inf.
            for r, d in T.Parallel(block_m, dim):
                if r < rows:
                    value = T.if_then_else(total[r] > 0, acc[r, d] / total[r], 0)
                    if split:
                        o_out[sp, b, r // group, hk * group + r % group, d] = value
                    else:
                        o_out[b, r // group, hk * group + r % group, d] = T.cast(value, dt)
            for r in T.Parallel(block_m):
                if r < rows:
                    lse2 = T.if_then_else(total[r] > 0, T.log2(total[r]) + row_shift[r], -T.infinity(f32))
                    if split:
                        lse_out[sp, b, hk * group + r % group, r // group] = lse2
                    else:
                        lse_out[b, hk * group + r % group, r // group] = lse2 * _LN2

    if split:
        o_type = T.Tensor((splits, batch, new_tokens, heads_q, dim), f32)
        lse_type = T.Tensor((splits, batch, heads_q, new_tokens), f32)
    else:
        o_type = T.Tensor(q_shape, dt)
        lse_type = T.Tensor((batch, heads_q, new_tokens), f32)

    # An optional input the kernel does not take is a non-buffer annotation: the parameter is
    # left out of the kernel's signature, as the launch leaves out the tensor.
    table_type = T.Tensor((batch, pages), "int32") if paged else 0
    mask_type = T.Tensor((batch, mask_width), "bool") if masked else 0

    @T.prim_func
    def main(
        q: T.Tensor(q_shape, dt), k_cache: T.Tensor(cache_shape, dt), v_cache: T.Tensor(cache_shape, dt),
        cache_seqlens: T.Tensor((batch,), "int32"), block_table: table_type, key_mask: mask_type,
        o_out: o_type, lse_out: lse_type,
    ):
        body(q, k_cache, v_cache, cache_seqlens, block_table, key_mask, o_out, lse_out)

    return main


def make_merge_program(dtype: torch.dtype, heads_q: int, head_dim: int, new_tokens: int):
    """The TileLang PrimFunc ``main(o_part, lse_part, o, lse)`` combining the splits of the
    module docstring: one block per output row (b, s, h), one thread per column."""
    import tilelang.language as T

    dt, f32 = _TL_DTYPES[dtype], "float32"
    batch = T.dynamic("batch")
    splits = T.dynamic("splits")
    rows = new_tokens * heads_q

    @T.prim_func
    def main(
        o_part: T.Tensor((splits, batch, new_tokens, heads_q, head_dim), f32),
        lse_part: T.Tensor((splits, batch, heads_q, new_tokens), f32),
        o: T.Tensor((batch, new_tokens, heads_q, head_dim), dt),
        lse: T.Tensor((batch, heads_q, new_tokens), f32),
    ):
        with T.Kernel(rows, batch, threads=head_dim) as (row, b):
            d = T.get_thread_binding()
            s = row // heads_q
            h = row % heads_q
            top = T.alloc_var(f32)
            shift = T.alloc_var(f32)
            total = T.alloc_var(f32)
            value = T.alloc_var(f32)
            top = -T.infinity(f32)
            for k in T.serial(splits):
                top = T.max(top, lse_part[k, b, h, s])
            # Every split empty: shift by 0, so that the weights are exp2(-inf) = 0, not NaN.
            shift = T.if_then_else(top == -T.infinity(f32), 0, top)
            total = 0
            for k in T.serial(splits):
                total += T.exp2(lse_part[k, b, h, s] - shift)
            value = 0
            for k in T.serial(splits):
                value += T.exp2(lse_part[k, b, h, s] - shift) * o_part[k, b, s, h, d]
            o[b, s, h, d] = T.cast(T.if_then_else(total > 0, value / total, 0), dt)
            if d == 0:
                lse[b, h, s] = T.if_then_else(total > 0, (T.log2(total) + shift) * _LN2, -T.infinity(f32))

    return main


def compile_attend(
    dtype, heads_q, heads_kv, head_dim, new_tokens, page_size, scale, causal, cache_layout, masked, target, **config
):
    """The compiled attend kernel of one configuration for ``target``, once per process (and on disk)."""
    identity = (
        "decode-attend", dtype, heads_q, heads_kv, head_dim, new_tokens, page_size, float(scale), causal, cache_layout,
        masked, tuple(sorted(config.items())),
    )
    return compile_once(
        identity,
        lambda: make_attend_program(
            dtype, heads_q, heads_kv, head_dim, new_tokens, page_size, scale, causal, cache_layout, masked, **config
        ),
        hopper_target(target),
    )


def compile_merge(dtype, heads_q, head_dim, new_tokens, target):
    """The compiled merge kernel for ``target``, once per process (and on disk)."""
    identity = ("decode-merge", dtype, heads_q, head_dim, new_tokens)
    return compile_once(identity, lambda: make_merge_program(dtype, heads_q, head_dim, new_tokens), target)
