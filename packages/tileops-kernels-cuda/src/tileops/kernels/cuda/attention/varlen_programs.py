"""The TileLang programs of variable-length attention (packed batches, ``cu_seqlens``), forward
and backward, and their compilation.

The totals T_q and T_k, the batch and the tile count are symbolic: one compiled program serves
every packed batch. The head size, head counts, masking, scale and dtype are compile-time
constants (the call spec), as in the dense programs (``programs``), whose tiles, online softmax
and flash-attention-2 backward these follow; what differs is where a block's rows come from.

Tiles and sequences: the blocks of a launch walk the packed rows in tiles of ``block`` rows
(query rows in the forward, key rows in the backward's main kernel). Sequence b owns the tiles
``first(b) .. first(b + 1) - 1`` with ``first(b) = cu_seqlens[b] // block + b``; since
``first(b + 1) - first(b) >= ceil(S_b / block)``, each sequence gets a tile per ``block`` of its
rows and at most one spare, so ``T // block + B`` tiles cover any lengths that sum to T, and the
grid is known on the host from the shapes alone. ``TILE_SEQ`` (one int32 per tile, computed on the
device by the kernel class) names each tile's sequence; a block reads its sequence's offsets from
``cu_seqlens`` on the device. A spare tile, past its sequence's rows, runs no loop iteration and
writes nothing. Offsets are clamped to the tensors, so offsets that break the rules cannot make
a block read or write outside them.

Rows of a tile past its sequence's end belong to the next sequence (or lie past the tensor,
which the loads fill with zeros): they are masked out of every score (a key) or never written (a
query row of o, lse, or a key row of dk, dv), so each sequence sees only its own rows.

- ``forward``: a block per (query tile, query head): Q in shared memory, K and V tiles through a
  ``T.Pipelined`` loop over the sequence's key blocks its causal and sliding windows reach,
  ``T.gemm`` (wgmma) into float32 fragments, the online softmax in base 2; o staged through Q's
  shared tile and written row by row within the sequence, lse likewise, (H, T_q).
- ``bwd_pre``: delta = rowsum(dO * O) - dlse and lse * log2(e), (H, T_pad) float32, over the packed
  rows (no sequence needed: each row's own values); rows past T_q are 0.
- ``bwd_main``: a block per (key tile, key/value head), the flash-attention-2 scheme: K and V in
  shared memory, the loop over the sequence's query blocks of every query head of the group, dK
  and dV in float32 registers (written row by row within the sequence), dQ added into a float32
  (H, T_pad, D) accumulator with atomics (a tile's rows past its sequence add exact zeros).
- ``bwd_post``: dQ cast from the accumulator to q's dtype, over the packed rows.

T_pad is T_q plus a tile of rows, so that the last sequence's last tile stays inside the
workspaces. Importing this module does not import tilelang; building a program does.
"""

# No `from __future__ import annotations`: TileLang evaluates the prim_func's annotations.

from ..compile import compile_once
from .programs import _TL_DTYPES, LN2, LOG2E, _visible, hopper_target, online_softmax_step, sees_whole, whole_key_blocks


def _sequence(cu_q, cu_k, b, total_q, total_k):
    """(query start, query length, key start, key length) of sequence b, its offsets clamped to
    the tensors (offsets that break the rules give empty or shortened sequences, never a row
    outside them)."""
    import tilelang.language as T

    q_start = T.min(T.max(cu_q[b], 0), total_q)
    k_start = T.min(T.max(cu_k[b], 0), total_k)
    q_len = T.min(T.max(cu_q[b + 1], q_start), total_q) - q_start
    k_len = T.min(T.max(cu_k[b + 1], k_start), total_k) - k_start
    return q_start, q_len, k_start, k_len


def make_forward(dtype, head_dim, heads_q, heads_kv, causal, window, scale, *, block_m, block_n, stages, threads):
    """``main(q, k, v, cu_q, cu_k, tile_seq, o, lse)``: o (T_q, H, D) and lse (H, T_q) for q
    (T_q, H, D) and k, v (T_k, HK, D); ``tile_seq`` has T_q // block_m + B entries."""
    import tilelang.language as T

    dt, acc = _TL_DTYPES[dtype], "float32"
    total_q, total_k = T.dynamic("total_q"), T.dynamic("total_k")
    offsets, tiles = T.dynamic("offsets"), T.dynamic("tiles")
    group = heads_q // heads_kv
    scale2 = scale * LOG2E
    step = online_softmax_step(causal, window, scale2, block_m, block_n, head_dim)

    @T.prim_func
    def main(
        Q: T.Tensor([total_q, heads_q, head_dim], dt),
        K: T.Tensor([total_k, heads_kv, head_dim], dt),
        V: T.Tensor([total_k, heads_kv, head_dim], dt),
        CU_Q: T.Tensor([offsets], "int32"),
        CU_K: T.Tensor([offsets], "int32"),
        TILE_SEQ: T.Tensor([tiles], "int32"),
        OUT: T.Tensor([total_q, heads_q, head_dim], dt),
        LSE: T.Tensor([heads_q, total_q], acc),
    ):
        with T.Kernel(tiles, heads_q, threads=threads) as (bx, by):
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

            b = T.min(T.max(TILE_SEQ[bx], 0), offsets - 2)
            q_start, s_q, k_start, s_k = _sequence(CU_Q, CU_K, b, total_q, total_k)
            q0 = (bx - (CU_Q[b] // block_m + b)) * block_m  # this tile's first row in its sequence
            kv_head = by // group
            offset = s_k - s_q
            T.copy(Q[q_start + q0 : q_start + q0 + block_m, by, :], q_tile)
            T.fill(o, 0)
            T.fill(row_sum, 0)
            T.fill(row_max, -T.infinity(acc))

            # The key blocks this query tile reaches (none for a spare tile): up to its last row's
            # causal limit, from its first row's window start.
            reach = T.min(s_k, T.max(q0 + block_m + offset, 0)) if causal else s_k
            stop = T.if_then_else(T.And(q0 >= 0, q0 < s_q), reach, 0)
            start = T.min(T.max(q0 + offset - window, 0), stop) if window is not None else 0
            # As the dense forward: the key blocks every row sees whole get no mask.
            whole_from, whole_to = whole_key_blocks(causal, window, q0, offset, s_k, block_m, block_n)
            for kb in T.Pipelined(start // block_n, T.ceildiv(stop, block_n), num_stages=stages):
                T.copy(K[k_start + kb * block_n : k_start + kb * block_n + block_n, kv_head, :], k_tile)
                whole = T.And(kb >= whole_from, kb < whole_to)
                step(q_tile, k_tile, s, p, o, row_max, prev_max, shift, rescale, tile_sum, row_sum, q0, kb * block_n, s_k, offset, whole)
                T.copy(V[k_start + kb * block_n : k_start + kb * block_n + block_n, kv_head, :], v_tile)
                T.gemm(p, v_tile, o, policy=T.GemmWarpPolicy.FullRow)

            for i, j in T.Parallel(block_m, head_dim):
                o[i, j] = T.if_then_else(row_sum[i] > 0, o[i, j] / row_sum[i], 0)
            T.copy(o, q_tile)  # Q is read no more: its tile stages o for the row-by-row store
            for i, j in T.Parallel(block_m, head_dim):
                if T.And(q0 + i >= 0, q0 + i < s_q):
                    OUT[q_start + q0 + i, by, j] = q_tile[i, j]
            for i in T.Parallel(block_m):
                if T.And(q0 + i >= 0, q0 + i < s_q):
                    LSE[by, q_start + q0 + i] = T.if_then_else(
                        row_sum[i] > 0, (T.log2(row_sum[i]) + row_max[i] * scale2) * LN2, -T.infinity(acc)
                    )

    return main


def make_bwd_pre(dtype, head_dim, heads_q, *, block_m, threads):
    """``main(do, o, lse, dlse, delta, lse2)``: delta = rowsum(do * o) - dlse and
    lse2 = lse * log2(e), both (H, T_pad) float32 (rows past T_q: 0)."""
    import tilelang.language as T

    dt, acc = _TL_DTYPES[dtype], "float32"
    total_q, total_pad = T.dynamic("total_q"), T.dynamic("total_pad")

    @T.prim_func
    def main(
        DO: T.Tensor([total_q, heads_q, head_dim], dt),
        OUT: T.Tensor([total_q, heads_q, head_dim], dt),
        LSE: T.Tensor([heads_q, total_q], acc),
        DLSE: T.Tensor([heads_q, total_q], acc),
        DELTA: T.Tensor([heads_q, total_pad], acc),
        LSE2: T.Tensor([heads_q, total_pad], acc),
    ):
        with T.Kernel(T.ceildiv(total_pad, block_m), heads_q, threads=threads) as (bx, by):
            do_tile = T.alloc_fragment([block_m, head_dim], acc)
            o_tile = T.alloc_fragment([block_m, head_dim], acc)
            dot = T.alloc_fragment([block_m], acc)
            r0 = bx * block_m
            T.copy(DO[r0 : r0 + block_m, by, :], do_tile)
            T.copy(OUT[r0 : r0 + block_m, by, :], o_tile)
            for i, j in T.Parallel(block_m, head_dim):
                do_tile[i, j] = do_tile[i, j] * o_tile[i, j]
            T.reduce_sum(do_tile, dot, dim=1)
            for i in T.Parallel(block_m):
                if r0 + i < total_q:
                    DELTA[by, r0 + i] = dot[i] - DLSE[by, r0 + i]
                    LSE2[by, r0 + i] = LSE[by, r0 + i] * LOG2E
                elif r0 + i < total_pad:
                    DELTA[by, r0 + i] = 0
                    LSE2[by, r0 + i] = 0

    return main


def make_bwd_main(dtype, head_dim, heads_q, heads_kv, causal, window, scale, *, block_n, block_m, stages, threads, split_columns):
    """``main(do, q, k, v, cu_q, cu_k, tile_seq, delta, lse2, dq_acc, dk, dv)``: dk and dv
    (T_k, HK, D) in k's dtype, and dq added (float32, (H, T_pad, D)) into ``dq_acc``, which must
    start at zero; ``tile_seq`` has T_k // block_n + B entries. ``split_columns`` as in the dense
    backward (``programs.make_bwd_main``)."""
    import tilelang.language as T

    dt, acc = _TL_DTYPES[dtype], "float32"
    total_q, total_k, total_pad = T.dynamic("total_q"), T.dynamic("total_k"), T.dynamic("total_pad")
    offsets, tiles = T.dynamic("offsets"), T.dynamic("tiles")
    group = heads_q // heads_kv
    scale2 = scale * LOG2E
    score_policy = T.GemmWarpPolicy.FullCol if split_columns else T.GemmWarpPolicy.FullRow

    @T.prim_func
    def main(
        DO: T.Tensor([total_q, heads_q, head_dim], dt),
        Q: T.Tensor([total_q, heads_q, head_dim], dt),
        K: T.Tensor([total_k, heads_kv, head_dim], dt),
        V: T.Tensor([total_k, heads_kv, head_dim], dt),
        CU_Q: T.Tensor([offsets], "int32"),
        CU_K: T.Tensor([offsets], "int32"),
        TILE_SEQ: T.Tensor([tiles], "int32"),
        DELTA: T.Tensor([heads_q, total_pad], acc),
        LSE2: T.Tensor([heads_q, total_pad], acc),
        DQ: T.Tensor([heads_q, total_pad, head_dim], acc),
        DK: T.Tensor([total_k, heads_kv, head_dim], dt),
        DV: T.Tensor([total_k, heads_kv, head_dim], dt),
    ):
        with T.Kernel(tiles, heads_kv, threads=threads) as (bx, by):
            k_tile = T.alloc_shared([block_n, head_dim], dt)
            v_tile = T.alloc_shared([block_n, head_dim], dt)
            q_tile = T.alloc_shared([block_m, head_dim], dt)
            do_tile = T.alloc_shared([block_m, head_dim], dt)
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
            out_tile = T.alloc_shared([block_n, head_dim], dt)

            b = T.min(T.max(TILE_SEQ[bx], 0), offsets - 2)
            q_start, s_q, k_start, s_k = _sequence(CU_Q, CU_K, b, total_q, total_k)
            k0 = (bx - (CU_K[b] // block_n + b)) * block_n  # this tile's first key in its sequence
            offset = s_k - s_q
            T.copy(K[k_start + k0 : k_start + k0 + block_n, by, :], k_tile)
            T.copy(V[k_start + k0 : k_start + k0 + block_n, by, :], v_tile)
            T.clear(dk)
            T.clear(dv)

            # The query blocks that see these keys (none for a spare tile): from the first row
            # whose causal limit reaches the first key, to the last row whose window holds the last.
            first = T.max(k0 - offset, 0) // block_m if causal else 0
            reach = T.min(s_q, k0 + block_n - offset + window) if window is not None else s_q
            last = T.ceildiv(T.max(reach, 0), block_m)
            blocks = T.if_then_else(T.And(k0 >= 0, k0 < s_k), T.max(last - first, 0), 0)
            for step in T.Pipelined(blocks * group, num_stages=stages):
                # blocks > 0 wherever the loop runs; the T.max keeps TileLang's index analysis,
                # which under the unmasked steps' windowed condition below folds blocks to zero,
                # from stopping the build on a division by zero.
                head = by * group + step // T.max(blocks, 1)
                q0 = (first + step % T.max(blocks, 1)) * block_m
                T.copy(Q[q_start + q0 : q_start + q0 + block_m, head, :], q_tile)
                T.clear(p)
                T.gemm(k_tile, q_tile, p, transpose_B=True, policy=score_policy)
                T.copy(DO[q_start + q0 : q_start + q0 + block_m, head, :], do_tile)
                T.clear(dp)
                T.gemm(v_tile, do_tile, dp, transpose_B=True, policy=score_policy)
                # The rows' lse2 and delta are read from global memory, not staged by TMA as in
                # the dense backward: here a tile starts at any packed row, so the box would start
                # anywhere in the innermost dimension and the workspaces' rows would have to be
                # 16-byte multiples (on the H200 TileLang refused that descriptor for a total of
                # 305 rows, and the TMA version stopped with an illegal instruction on 16k-token
                # packed batches). 64 floats a step, read through L1, beside two 64 x 128 products.
                # As the dense backward: a step every row of which sees every key takes no mask.
                if sees_whole(causal, window, q0, k0, offset, s_q, s_k, block_m, block_n):
                    for i, j in T.Parallel(block_n, block_m):
                        p[i, j] = T.exp2(p[i, j] * scale2 - LSE2[head, q_start + q0 + j])
                else:
                    for i, j in T.Parallel(block_n, block_m):
                        seen = T.And(q0 + j < s_q, _visible(causal, window, q0 + j, k0 + i, s_k, offset))
                        p[i, j] = T.if_then_else(seen, T.exp2(p[i, j] * scale2 - LSE2[head, q_start + q0 + j]), 0)
                T.copy(p, p_cast)
                for i, j in T.Parallel(block_n, block_m):
                    ds_cast[i, j] = p[i, j] * (dp[i, j] - DELTA[head, q_start + q0 + j]) * scale
                T.copy(ds_cast, ds_tile)
                if split_columns:
                    T.copy(p_cast, p_tile)
                    T.gemm(p_tile, do_tile, dv, policy=T.GemmWarpPolicy.FullCol)
                    T.gemm(ds_tile, q_tile, dk, policy=T.GemmWarpPolicy.FullCol)
                else:
                    T.gemm(p_cast, do_tile, dv, policy=T.GemmWarpPolicy.FullRow)
                    T.gemm(ds_cast, q_tile, dk, policy=T.GemmWarpPolicy.FullRow)
                T.clear(dq)
                T.gemm(ds_tile, k_tile, dq, transpose_A=True)
                T.atomic_add(DQ[head, q_start + q0 : q_start + q0 + block_m, :], dq)

            T.copy(dv, out_tile)
            for i, j in T.Parallel(block_n, head_dim):
                if T.And(k0 + i >= 0, k0 + i < s_k):
                    DV[k_start + k0 + i, by, j] = out_tile[i, j]
            T.copy(dk, out_tile)
            for i, j in T.Parallel(block_n, head_dim):
                if T.And(k0 + i >= 0, k0 + i < s_k):
                    DK[k_start + k0 + i, by, j] = out_tile[i, j]

    return main


def make_bwd_post(dtype, head_dim, heads_q, *, block_m, threads):
    """``main(dq_acc, dq)``: the float32 (H, T_pad, D) accumulator cast to q's dtype, (T_q, H, D)."""
    import tilelang.language as T

    dt, acc = _TL_DTYPES[dtype], "float32"
    total_q, total_pad = T.dynamic("total_q"), T.dynamic("total_pad")

    @T.prim_func
    def main(DQ_ACC: T.Tensor([heads_q, total_pad, head_dim], acc), DQ: T.Tensor([total_q, heads_q, head_dim], dt)):
        with T.Kernel(T.ceildiv(total_q, block_m), heads_q, threads=threads) as (bx, by):
            tile = T.alloc_fragment([block_m, head_dim], acc)
            cast = T.alloc_fragment([block_m, head_dim], dt)
            r0 = bx * block_m
            T.copy(DQ_ACC[by, r0 : r0 + block_m, :], tile)
            T.copy(tile, cast)
            T.copy(cast, DQ[r0 : r0 + block_m, by, :])

    return main


def _spec(call) -> tuple:
    return (call.dtype, call.head_dim, call.heads_q, call.heads_kv, call.causal, call.window, call.scale)


def compile_forward(call, target: dict, **config):
    """The compiled forward of a call spec (``VarlenAttentionCall``) and configuration, once per process."""
    identity = ("varlen_attention_fwd", *_spec(call), tuple(sorted(config.items())))
    return compile_once(identity, lambda: make_forward(*_spec(call), **config), hopper_target(target))


def compile_bwd_pre(call, target: dict, **config):
    identity = ("varlen_attention_bwd_pre", call.dtype, call.head_dim, call.heads_q, tuple(sorted(config.items())))
    make = lambda: make_bwd_pre(call.dtype, call.head_dim, call.heads_q, **config)  # noqa: E731
    return compile_once(identity, make, hopper_target(target))


def compile_bwd_main(call, target: dict, **config):
    identity = ("varlen_attention_bwd", *_spec(call), tuple(sorted(config.items())))
    return compile_once(identity, lambda: make_bwd_main(*_spec(call), **config), hopper_target(target))


def compile_bwd_post(call, target: dict, **config):
    identity = ("varlen_attention_bwd_post", call.dtype, call.head_dim, call.heads_q, tuple(sorted(config.items())))
    make = lambda: make_bwd_post(call.dtype, call.head_dim, call.heads_q, **config)  # noqa: E731
    return compile_once(identity, make, hopper_target(target))
