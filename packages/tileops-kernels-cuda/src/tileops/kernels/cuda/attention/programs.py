"""The TileLang programs of the attention kernels (flash attention, forward and backward), and
their compilation.

Batch, query length and key length are symbolic, so one compiled program serves every length;
the head size, head counts, masking, scale, layout and dtype are compile-time constants (the
call spec). Masks are applied per element where a tile may hold masked entries and skipped
where whole tiles are masked: each query block visits only the key blocks its causal window and
sliding window reach, and each key block only the query blocks that see it. Softmax statistics
are float32 in the base-2 domain (scores times scale * log2(e), one ``exp2`` per element).

- ``forward``: one block per (query block, query head, batch). Q stays in shared memory; K and V
  tiles stream through a ``T.Pipelined`` loop of ``stages`` buffers; S = Q K^T and O += P V are
  ``T.gemm`` (wgmma on sm_90) into float32 fragments, with the online softmax between them. A
  row that has seen no key yet keeps a maximum of -inf, which is read as 0 so that no
  ``-inf - -inf`` appears. o is written as acc / sum (0 where the row saw no key), lse as
  log(sum) + max in natural-log units (-inf where it saw none).
- ``bwd_pre``: delta = rowsum(dO * O) - dlse and lse * log2(e), each (B, H_q, S_pad) float32,
  one block per (query block, head, batch): the main kernel reads them as contiguous tiles.
- ``bwd_main``: one block per (key block, key/value head, batch), the flash-attention-2 scheme.
  K and V stay in shared memory; the loop runs over the query blocks of every query head of the
  group (GQA without atomics on dK, dV), recomputing P^T = exp2(K Q^T * scale2 - lse2) and
  dP^T = V dO^T, accumulating dV += P^T dO and dK += dS^T Q in float32 registers
  (dS = P (dP - delta) * scale), and adding dQ = dS K into a float32 (B, H_q, S_pad, D)
  accumulator with atomics.
- ``bwd_post``: dQ cast from the accumulator to q's dtype and layout.

Importing this module does not import tilelang; building a program does.
"""

# No `from __future__ import annotations`: TileLang evaluates the prim_func's annotations.

import torch

from ..compile import compile_once
from ..device import hopper_target
from .policy import WGMMA_ROWS

_TL_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16"}
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


def _shapes(layout: str, batch, seq, heads: int, head_dim: int):
    return [batch, seq, heads, head_dim] if layout == "bshd" else [batch, heads, seq, head_dim]


def _rows(tensor, layout: str, b, start, extent: int, h):
    """The region of ``extent`` sequence rows from ``start`` of head h, batch b, in ``layout``."""
    if layout == "bshd":
        return tensor[b, start : start + extent, h, :]
    return tensor[b, h, start : start + extent, :]


def _visible(causal: bool, window, row, col, s_k, offset):
    """Whether query row ``row`` sees key ``col`` (both absolute), as a TileLang condition."""
    import tilelang.language as T

    ok = col < s_k
    if causal:
        ok = T.And(ok, col <= row + offset)
    if window is not None:
        ok = T.And(ok, col >= row + offset - window)
    return ok


def whole_key_blocks(causal: bool, window, q0, offset, s_k, block_m: int, block_n: int):
    """(first, end) of the key blocks that every row of the query block from row ``q0`` sees
    whole, which need no mask: from its last row's window start, before its first row's causal
    limit and the last key (empty where there are none)."""
    import tilelang.language as T

    first = T.ceildiv(T.max(q0 + block_m - 1 + offset - window, 0), block_n) if window is not None else 0
    end = T.min(T.max(q0 + offset + 1, 0) // block_n, s_k // block_n) if causal else s_k // block_n
    return first, end


def sees_whole(causal: bool, window, q0, k0, offset, s_q, s_k, block_m: int, block_n: int):
    """Whether every row of the query block from row ``q0`` (each before ``s_q``) sees every key
    of the key block from ``k0`` (each before ``s_k``): the backward's condition for leaving a
    step's scores unmasked."""
    import tilelang.language as T

    whole = T.And(q0 + block_m <= s_q, k0 + block_n <= s_k)
    if causal:
        whole = T.And(whole, k0 + block_n - 1 <= q0 + offset)
    if window is not None:
        whole = T.And(whole, k0 >= q0 + block_m - 1 + offset - window)
    return whole


def online_softmax_step(causal: bool, window, scale2: float, block_m: int, block_n: int, head_dim: int):
    """The forward's step over one key block, as a TileLang macro (inlined where a program calls
    it) that the dense and the variable-length forwards share: S = Q K^T masked to the keys each
    row sees, the running maximum and sum in base 2, o rescaled by the maximum's change, and
    P = exp2(S * scale2 - shift) cast into ``p``; the caller loads V and adds P V into o.
    ``q0`` and ``k0`` are the block's first query and key within their sequence; ``whole``: every
    row sees every key of the block (a condition the caller derives), so S needs no mask."""
    import tilelang.language as T

    acc = "float32"

    @T.macro
    def step(q_tile, k_tile, s, p, o, row_max, prev_max, shift, rescale, tile_sum, row_sum, q0, k0, s_k, offset, whole=False):
        if whole:
            T.clear(s)
        else:
            for i, j in T.Parallel(block_m, block_n):
                seen = _visible(causal, window, q0 + i, k0 + j, s_k, offset)
                s[i, j] = T.if_then_else(seen, 0, -T.infinity(acc))
        T.gemm(q_tile, k_tile, s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
        T.copy(row_max, prev_max)
        T.reduce_max(s, row_max, dim=1, clear=False)
        for i in T.Parallel(block_m):
            # -inf (no key seen yet) shifts by 0: exp2(-inf - 0) = 0, never NaN.
            shift[i] = T.if_then_else(row_max[i] == -T.infinity(acc), 0, row_max[i] * scale2)
            rescale[i] = T.exp2(prev_max[i] * scale2 - shift[i])
        for i, j in T.Parallel(block_m, block_n):
            s[i, j] = T.exp2(s[i, j] * scale2 - shift[i])
        T.reduce_sum(s, tile_sum, dim=1)
        for i in T.Parallel(block_m):
            row_sum[i] = row_sum[i] * rescale[i] + tile_sum[i]
        for i, j in T.Parallel(block_m, head_dim):
            o[i, j] *= rescale[i]
        T.copy(s, p)

    return step


def make_forward(dtype, head_dim, heads_q, heads_kv, causal, window, scale, layout, *, block_m, block_n, stages, threads):
    """``main(q, k, v, o, lse)``: o and lse for q (B, S_q, H_q, D) and k, v (B, S_k, H_kv, D) in
    ``layout`` (bhsd swaps the middle dimensions; lse is (B, H_q, S_q) in bshd, (B, S_q, H_q) in
    bhsd)."""
    import tilelang.language as T

    dt, acc = _TL_DTYPES[dtype], "float32"
    batch, s_q, s_k = T.dynamic("batch"), T.dynamic("s_q"), T.dynamic("s_k")
    group = heads_q // heads_kv
    scale2 = scale * LOG2E
    q_shape = _shapes(layout, batch, s_q, heads_q, head_dim)
    kv_shape = _shapes(layout, batch, s_k, heads_kv, head_dim)
    lse_shape = [batch, heads_q, s_q] if layout == "bshd" else [batch, s_q, heads_q]
    step = online_softmax_step(causal, window, scale2, block_m, block_n, head_dim)

    @T.prim_func
    def main(
        Q: T.Tensor(q_shape, dt),
        K: T.Tensor(kv_shape, dt),
        V: T.Tensor(kv_shape, dt),
        OUT: T.Tensor(q_shape, dt),
        LSE: T.Tensor(lse_shape, acc),
    ):
        with T.Kernel(T.ceildiv(s_q, block_m), heads_q, batch, threads=threads) as (bx, by, bz):
            q_tile = T.alloc_shared([block_m, head_dim], dt)
            k_tile = T.alloc_shared([block_n, head_dim], dt)
            v_tile = T.alloc_shared([block_n, head_dim], dt)
            s = T.alloc_fragment([block_m, block_n], acc)
            p = T.alloc_fragment([block_m, block_n], dt)
            o = T.alloc_fragment([block_m, head_dim], acc)
            row_max = T.alloc_fragment([block_m], acc)
            prev_max = T.alloc_fragment([block_m], acc)
            shift = T.alloc_fragment([block_m], acc)
            rescale = T.alloc_fragment([block_m], acc)
            tile_sum = T.alloc_fragment([block_m], acc)
            row_sum = T.alloc_fragment([block_m], acc)

            q0 = bx * block_m
            kv_head = by // group
            offset = s_k - s_q
            T.copy(_rows(Q, layout, bz, q0, block_m, by), q_tile)
            T.fill(o, 0)
            T.fill(row_sum, 0)
            T.fill(row_max, -T.infinity(acc))

            # The key blocks this query block reaches: up to its last row's causal limit, from
            # its first row's window start.
            stop = T.min(s_k, T.max(q0 + block_m + offset, 0)) if causal else s_k
            start = T.max(q0 + offset - window, 0) if window is not None else 0
            # The key blocks every row of this query block sees whole get no mask: a mask
            # is a few integer compares per score, which the exponentials' pass waits behind.
            # H100, bf16, 32/8 heads, same outputs bit for bit: causal D 64 (4 x 2048) 284.5 ->
            # 260.4 us, D 128 (4 x 4096) 1218.5 -> 1156.3 us, with a window of 1023 keys 591.3 ->
            # 392.3 us (its mask has three bounds), full attention 1031.2 -> 1018.6 us.
            whole_from, whole_to = whole_key_blocks(causal, window, q0, offset, s_k, block_m, block_n)
            for kb in T.Pipelined(start // block_n, T.ceildiv(stop, block_n), num_stages=stages):
                T.copy(_rows(K, layout, bz, kb * block_n, block_n, kv_head), k_tile)
                whole = T.And(kb >= whole_from, kb < whole_to)
                step(q_tile, k_tile, s, p, o, row_max, prev_max, shift, rescale, tile_sum, row_sum, q0, kb * block_n, s_k, offset, whole)
                T.copy(_rows(V, layout, bz, kb * block_n, block_n, kv_head), v_tile)
                T.gemm(p, v_tile, o, policy=T.GemmWarpPolicy.FullRow)

            for i, j in T.Parallel(block_m, head_dim):
                o[i, j] = T.if_then_else(row_sum[i] > 0, o[i, j] / row_sum[i], 0)
            T.copy(o, _rows(OUT, layout, bz, q0, block_m, by))
            for i in T.Parallel(block_m):
                if q0 + i < s_q:
                    value = T.if_then_else(
                        row_sum[i] > 0, (T.log2(row_sum[i]) + row_max[i] * scale2) * LN2, -T.infinity(acc)
                    )
                    if layout == "bshd":
                        LSE[bz, by, q0 + i] = value
                    else:
                        LSE[bz, q0 + i, by] = value

    return main


def make_bwd_pre(dtype, head_dim, heads_q, layout, *, block_m, threads):
    """``main(do, o, lse, dlse, delta, lse2)``: delta = rowsum(do * o) - dlse and
    lse2 = lse * log2(e), both (B, H_q, S_pad) float32 (rows past S_q: 0)."""
    import tilelang.language as T

    dt, acc = _TL_DTYPES[dtype], "float32"
    batch, s_q, s_pad = T.dynamic("batch"), T.dynamic("s_q"), T.dynamic("s_pad")
    q_shape = _shapes(layout, batch, s_q, heads_q, head_dim)
    lse_shape = [batch, heads_q, s_q] if layout == "bshd" else [batch, s_q, heads_q]
    stat_shape = [batch, heads_q, s_pad]

    @T.prim_func
    def main(
        DO: T.Tensor(q_shape, dt),
        OUT: T.Tensor(q_shape, dt),
        LSE: T.Tensor(lse_shape, acc),
        DLSE: T.Tensor(lse_shape, acc),
        DELTA: T.Tensor(stat_shape, acc),
        LSE2: T.Tensor(stat_shape, acc),
    ):
        with T.Kernel(T.ceildiv(s_pad, block_m), heads_q, batch, threads=threads) as (bx, by, bz):
            do_tile = T.alloc_fragment([block_m, head_dim], acc)
            o_tile = T.alloc_fragment([block_m, head_dim], acc)
            dot = T.alloc_fragment([block_m], acc)
            q0 = bx * block_m
            T.copy(_rows(DO, layout, bz, q0, block_m, by), do_tile)
            T.copy(_rows(OUT, layout, bz, q0, block_m, by), o_tile)
            for i, j in T.Parallel(block_m, head_dim):
                do_tile[i, j] = do_tile[i, j] * o_tile[i, j]
            T.reduce_sum(do_tile, dot, dim=1)
            for i in T.Parallel(block_m):
                if q0 + i < s_q:
                    if layout == "bshd":
                        DELTA[bz, by, q0 + i] = dot[i] - DLSE[bz, by, q0 + i]
                        LSE2[bz, by, q0 + i] = LSE[bz, by, q0 + i] * LOG2E
                    else:
                        DELTA[bz, by, q0 + i] = dot[i] - DLSE[bz, q0 + i, by]
                        LSE2[bz, by, q0 + i] = LSE[bz, q0 + i, by] * LOG2E
                elif q0 + i < s_pad:
                    DELTA[bz, by, q0 + i] = 0
                    LSE2[bz, by, q0 + i] = 0

    return main


def accumulates_kv_in_float32(per_query_head: bool, heads_q: int, heads_kv: int) -> bool:
    """Whether the backward main kernel adds dK and dV into float32 accumulators (padded to whole
    key blocks, cast by the caller) rather than writing them in k's dtype: where a block per
    query head leaves several blocks adding into one key/value head's gradients (GQA)."""
    return per_query_head and heads_q > heads_kv


def make_bwd_main(
    dtype, head_dim, heads_q, heads_kv, causal, window, scale, layout, *, block_n, block_m, stages, threads, split_columns,
    overlap=False, per_query_head=False, dq_by_tma=False,
):
    """``main(do, q, k, v, delta, lse2, dq_acc, dk, dv)``: dk and dv in k's layout, and dq
    (float32, (B, H_q, S_pad, D)) added into ``dq_acc``, which must start at zero.
    ``block_n`` key rows per block, ``block_m`` query rows per step. ``split_columns``: the
    warpgroups split the key block's (block_n, D) accumulators by columns (a key block of fewer
    rows than 64 per warpgroup, as D = 256 needs to keep dK and dV in registers), so P^T and dS^T
    reach the dV and dK products through shared memory rather than each warpgroup's registers.
    ``overlap``: the products are issued asynchronously (the two score products back to back,
    dV's beside the computation of dS), each waited for where its result is read.
    ``per_query_head``: one block per (key block, query head) instead of per key/value head, each
    block looping over its own head's query blocks; with several query heads per key/value head
    dk and dv are then float32 accumulators in k's layout, their key rows padded to a multiple
    of ``block_n``, added into with atomics, which must start at zero. ``dq_by_tma``: a step's
    dQ goes through shared memory into the accumulator by one TMA reduce-add, not by each
    thread's atomic adds."""
    import tilelang.language as T

    dt, acc = _TL_DTYPES[dtype], "float32"
    batch, s_q, s_k, s_pad = T.dynamic("batch"), T.dynamic("s_q"), T.dynamic("s_k"), T.dynamic("s_pad")
    group = heads_q // heads_kv
    scale2 = scale * LOG2E
    q_shape = _shapes(layout, batch, s_q, heads_q, head_dim)
    kv_shape = _shapes(layout, batch, s_k, heads_kv, head_dim)
    stat_shape = [batch, heads_q, s_pad]
    acc_shape = [batch, heads_q, s_pad, head_dim]
    score_policy = T.GemmWarpPolicy.FullCol if split_columns else T.GemmWarpPolicy.FullRow
    accumulate_kv = accumulates_kv_in_float32(per_query_head, heads_q, heads_kv)
    kv_grad_dtype = acc if accumulate_kv else dt
    # The accumulators' rows are padded to whole key blocks: a tile's atomic add checks no bounds.
    kv_grad_shape = _shapes(layout, batch, T.dynamic("s_k_pad"), heads_kv, head_dim) if accumulate_kv else kv_shape
    gemm = T.wgmma_gemm if overlap else T.gemm
    # The dQ product's M is block_m; under 64 rows it cannot be a wgmma of both warpgroups.
    dq_gemm = gemm if block_m >= WGMMA_ROWS else T.gemm
    blocks_per_kv_head = heads_q if per_query_head else heads_kv
    steps_per_block = 1 if per_query_head else group

    @T.prim_func
    def main(
        DO: T.Tensor(q_shape, dt),
        Q: T.Tensor(q_shape, dt),
        K: T.Tensor(kv_shape, dt),
        V: T.Tensor(kv_shape, dt),
        DELTA: T.Tensor(stat_shape, acc),
        LSE2: T.Tensor(stat_shape, acc),
        DQ: T.Tensor(acc_shape, acc),
        DK: T.Tensor(kv_grad_shape, kv_grad_dtype),
        DV: T.Tensor(kv_grad_shape, kv_grad_dtype),
    ):
        with T.Kernel(T.ceildiv(s_k, block_n), blocks_per_kv_head, batch, threads=threads) as (bx, by, bz):
            k_tile = T.alloc_shared([block_n, head_dim], dt)
            v_tile = T.alloc_shared([block_n, head_dim], dt)
            q_tile = T.alloc_shared([block_m, head_dim], dt)
            do_tile = T.alloc_shared([block_m, head_dim], dt)
            lse2 = T.alloc_shared([block_m], acc)
            delta = T.alloc_shared([block_m], acc)
            ds_tile = T.alloc_shared([block_n, block_m], dt)
            p = T.alloc_fragment([block_n, block_m], acc)
            dp = T.alloc_fragment([block_n, block_m], acc)
            p_cast = T.alloc_fragment([block_n, block_m], dt)
            ds_cast = T.alloc_fragment([block_n, block_m], dt)
            if split_columns:
                p_tile = T.alloc_shared([block_n, block_m], dt)
            dk = T.alloc_fragment([block_n, head_dim], acc)
            dv = T.alloc_fragment([block_n, head_dim], acc)
            dq = T.alloc_fragment([block_m, head_dim], acc)
            if dq_by_tma:
                dq_shared = T.alloc_shared([block_m, head_dim], acc)
            out_tile = T.alloc_shared([block_n, head_dim], kv_grad_dtype)
            if overlap:
                touch = T.alloc_local([2], dt)

            kv_head = by // group if per_query_head else by
            k0 = bx * block_n
            offset = s_k - s_q
            T.copy(_rows(K, layout, bz, k0, block_n, kv_head), k_tile)
            T.copy(_rows(V, layout, bz, k0, block_n, kv_head), v_tile)
            T.clear(dk)
            T.clear(dv)

            # The query blocks that see these keys: from the first row whose causal limit reaches
            # the first key, to the last row whose window still holds the last key.
            first = T.max(k0 - offset, 0) // block_m if causal else 0
            reach = T.min(s_q, k0 + block_n - offset + window) if window is not None else s_q
            last = T.ceildiv(T.max(reach, 0), block_m)
            blocks = T.max(last - first, 0)
            for step in T.Pipelined(blocks * steps_per_block, num_stages=stages):
                head = by if per_query_head else by * group + step // blocks
                q0 = (first + step % blocks) * block_m
                T.copy(_rows(Q, layout, bz, q0, block_m, head), q_tile)
                # The score products start from zero inside the product (clear_accum: the first
                # k-step's accumulator scale is 0), not after a fill: nvcc sank dP^T's fill between
                # the two issues, where ptxas then waited for P^T's product to finish (its C7517
                # note in a verbose build), so the two ran one after the other. Same arithmetic.
                gemm(k_tile, q_tile, p, transpose_B=True, policy=score_policy, clear_accum=True)
                T.copy(_rows(DO, layout, bz, q0, block_m, head), do_tile)
                gemm(v_tile, do_tile, dp, transpose_B=True, policy=score_policy, clear_accum=True)
                T.copy(LSE2[bz, head, q0 : q0 + block_m], lse2)
                T.copy(DELTA[bz, head, q0 : q0 + block_m], delta)
                if overlap:
                    T.wait_wgmma(1)  # P^T's product done; dP^T's may still run
                # A step every row of which sees every key takes no mask, so the per-element test
                # is paid on the diagonal and edge blocks alone (H100, bf16, 32/8 heads: causal D 64
                # at 4 x 2048 857 -> 717 us, causal D 128 at 4 x 4096 3963 -> 3467 us, full D 128 at
                # 2 x 4096 3597 -> 3170 us, a 1023-key window 1447 -> 1039 us; D 256 unchanged).
                if sees_whole(causal, window, q0, k0, offset, s_q, s_k, block_m, block_n):
                    for i, j in T.Parallel(block_n, block_m):
                        p[i, j] = T.exp2(p[i, j] * scale2 - lse2[j])
                else:
                    for i, j in T.Parallel(block_n, block_m):
                        seen = T.And(q0 + j < s_q, _visible(causal, window, q0 + j, k0 + i, s_k, offset))
                        p[i, j] = T.if_then_else(seen, T.exp2(p[i, j] * scale2 - lse2[j]), 0)
                if overlap:
                    T.wait_wgmma(0)
                T.copy(p, p_cast)
                if split_columns:
                    T.copy(p_cast, p_tile)
                    gemm(p_tile, do_tile, dv, policy=T.GemmWarpPolicy.FullCol)
                else:
                    gemm(p_cast, do_tile, dv, policy=T.GemmWarpPolicy.FullRow)
                for i, j in T.Parallel(block_n, block_m):
                    ds_cast[i, j] = p[i, j] * (dp[i, j] - delta[j]) * scale
                T.copy(ds_cast, ds_tile)
                if split_columns:
                    gemm(ds_tile, q_tile, dk, policy=T.GemmWarpPolicy.FullCol)
                else:
                    gemm(ds_cast, q_tile, dk, policy=T.GemmWarpPolicy.FullRow)
                T.clear(dq)
                dq_gemm(ds_tile, k_tile, dq, transpose_A=True)
                if overlap:
                    T.wait_wgmma(0)
                    # The loop hands the Q and dO buffers back to the loads after the last
                    # statement that reads them, but an issued product reads them until waited
                    # for (dK's and dV's were issued without a wait): a one-element read of each
                    # after the wait keeps the hand-back behind it. H100, bf16, causal: the main
                    # kernel's time unchanged (D 64 711 -> 707 us, D 128 1770 -> 1775 us).
                    touch[0] = q_tile[0, 0]
                    touch[1] = do_tile[0, 0]
                if dq_by_tma:
                    T.copy(dq, dq_shared)
                    T.atomic_add(DQ[bz, head, q0 : q0 + block_m, :], dq_shared, use_tma=True)
                else:
                    T.atomic_add(DQ[bz, head, q0 : q0 + block_m, :], dq)

            T.copy(dv, out_tile)
            if accumulate_kv:
                T.atomic_add(_rows(DV, layout, bz, k0, block_n, kv_head), out_tile)
            else:
                T.copy(out_tile, _rows(DV, layout, bz, k0, block_n, kv_head))
            T.copy(dk, out_tile)
            if accumulate_kv:
                T.atomic_add(_rows(DK, layout, bz, k0, block_n, kv_head), out_tile)
            else:
                T.copy(out_tile, _rows(DK, layout, bz, k0, block_n, kv_head))

    return main


def make_bwd_post(dtype, head_dim, heads_q, layout, *, block_m, threads):
    """``main(dq_acc, dq)``: the float32 (B, H_q, S_pad, D) accumulator cast to q's dtype and
    layout."""
    import tilelang.language as T

    dt, acc = _TL_DTYPES[dtype], "float32"
    batch, s_q, s_pad = T.dynamic("batch"), T.dynamic("s_q"), T.dynamic("s_pad")
    q_shape = _shapes(layout, batch, s_q, heads_q, head_dim)

    @T.prim_func
    def main(DQ_ACC: T.Tensor([batch, heads_q, s_pad, head_dim], acc), DQ: T.Tensor(q_shape, dt)):
        with T.Kernel(T.ceildiv(s_q, block_m), heads_q, batch, threads=threads) as (bx, by, bz):
            tile = T.alloc_fragment([block_m, head_dim], acc)
            cast = T.alloc_fragment([block_m, head_dim], dt)
            q0 = bx * block_m
            T.copy(DQ_ACC[bz, by, q0 : q0 + block_m, :], tile)
            T.copy(tile, cast)
            T.copy(cast, _rows(DQ, layout, bz, q0, block_m, by))

    return main


def compile_forward(call, target: dict, **config):
    """The compiled forward of a call spec (``AttentionCall``) and configuration, once per process."""
    spec = (call.dtype, call.head_dim, call.heads_q, call.heads_kv, call.causal, call.window, call.scale, call.layout)
    identity = ("attention_fwd", *spec, tuple(sorted(config.items())))
    return compile_once(identity, lambda: make_forward(*spec, **config), hopper_target(target))


def compile_bwd_pre(call, target: dict, **config):
    identity = ("attention_bwd_pre", call.dtype, call.head_dim, call.heads_q, call.layout, tuple(sorted(config.items())))
    make = lambda: make_bwd_pre(call.dtype, call.head_dim, call.heads_q, call.layout, **config)  # noqa: E731
    return compile_once(identity, make, hopper_target(target))


def compile_bwd_main(call, target: dict, **config):
    spec = (call.dtype, call.head_dim, call.heads_q, call.heads_kv, call.causal, call.window, call.scale, call.layout)
    identity = ("attention_bwd", *spec, tuple(sorted(config.items())))
    return compile_once(identity, lambda: make_bwd_main(*spec, **config), hopper_target(target))


def compile_bwd_post(call, target: dict, **config):
    identity = ("attention_bwd_post", call.dtype, call.head_dim, call.heads_q, call.layout, tuple(sorted(config.items())))
    make = lambda: make_bwd_post(call.dtype, call.head_dim, call.heads_q, call.layout, **config)  # noqa: E731
    return compile_once(identity, make, hopper_target(target))
