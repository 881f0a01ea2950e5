"""TileLang programs for the backward pass of row normalisations (CUDA), and their launch rules.

With xhat = (x - mean) * rstd (rms kinds: x * rstd) and g = dy * weight (dy without weight):

* dx = rstd * (g - mean(g) - xhat * mean(g * xhat))   (rms kinds: no mean(g) term)
  (+ dresidual_sum for the fused kinds, whose x is the saved residual sum s)
* dweight = sum over rows of dy * xhat, dbias = sum over rows of dy.

Two kernels per call. The row kernel makes one pass over the rows, reading dy, x (and
dresidual_sum) and the saved statistics: the forward's mean and rstd are never recomputed. Its
blocks are persistent: ``partial_rows`` row slots, each a group of threads that owns a fixed
set of columns, walk the rows slot, slot + S, ... and sum dy * xhat (and dy) for their columns
in float32; each slot writes its own row of the float32 partials (parts, S, n) - no atomics.
The reduce kernel sums the partials over the slots and casts dweight (and dbias) to the dtype.

Modes of the row kernel (``launch_config``):

* ``register``: 16-byte vectors; a thread keeps its slice of the row of x and dy in registers
  between the row's reduction and dx, so x and dy are read once; the column sums live in
  registers, or in shared memory where the register file cannot hold them (``_accumulators``).
  With ``prefetch`` a thread loads its slice of its slot's next row while it reduces and
  writes the current one, and the fused kinds load the row's dresidual_sum before reducing it
  (``_prefetches`` says where; for the fused kinds, ``_fused_vectors`` picks the vectors per
  thread and the prefetch together).
* ``streamed``: any row length; x and dy are read again for dx (from L1/L2, the row was just
  read), and each slot adds its column sums into its own partial row in global memory at each
  row. With 16-byte vectors for long aligned rows, element-wise (vec = 1) for every length and
  alignment (the general fallback).

Kernel call convention (positional, caller-allocated outputs, rank-2 rows, no out_idx)::

    row kernel     (dy, [dresidual_sum], x, [weight], [mean], rstd, dx, partials)
    reduce kernel  (partials, dweight, [dbias])

Importing this module does not import tilelang; only building a program does.
"""

# No `from __future__ import annotations`: TileLang evaluates the prim_func annotations.

import math

import torch

from ..compile import compile_once
from .policy import DTYPES, MAX_THREADS, KINDS

_TL_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}
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


def _pow2_ceil(v: int) -> int:
    return 1 << max(0, (v - 1).bit_length())


def refusal(kind: str, variant: str, n: int, dtype: torch.dtype, aligned: bool) -> str | None:
    """None if ``variant`` serves (kind, n, dtype, aligned), else why not."""
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
    return None


def _registers(kind: str, dtype: torch.dtype, columns: int, acc: str, prefetch: bool = False) -> int:
    """Registers a thread of the register mode needs: x, dy and weight of its columns (and the
    next row's x and dy, and the fused kinds' dresidual_sum, with ``prefetch``), their sums."""
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
    registers (the estimate's count for it is not checked against ptxas)."""
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


def _accumulators(kind: str, dtype: torch.dtype, columns: int, threads: int) -> str | None:
    """Where the register mode keeps its column sums: in registers when a block's registers fit
    half the register file (two blocks per SM, one loading while the other reduces), else in
    shared memory when they fit it and the rest of the registers fit the file; None: neither."""
    if threads * _registers(kind, dtype, columns, "register") <= REGISTER_FILE // 2:
        return "register"
    shared = parts_of(kind) * columns * threads * 4
    if shared <= _SHARED_ACCUMULATOR_BYTES and threads * _registers(kind, dtype, columns, "shared") <= REGISTER_FILE:
        return "shared"
    return None


def launch_config(kind: str, variant: str, n: int, dtype: torch.dtype, vectors: int | None = None) -> dict:
    """The row kernel's launch configuration: vec (elements per access), tpr (threads per row,
    a power of two), rows (row slots per block), mode, acc (register mode: where the column sums
    live), unroll (vectors per thread: all of them in the register mode, those in flight per step
    in the streamed one), prefetch (register mode: the next row loaded ahead). ``vectors``: the
    register mode's vectors per thread where the row has enough of them for 1024 threads; None:
    the fused kinds' rule (``_fused_vectors``) where it has a configuration, else two (as the
    forward's rms_norm)."""
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
        tpr = min(_pow2_ceil(math.ceil(nv / (vectors or 2))), MAX_THREADS)
        per_thread = math.ceil(nv / tpr)
        rows = max(1, BLOCK_THREADS // tpr)
        acc, prefetch = None, False
        if per_thread <= _MAX_VECTORS_PER_THREAD:
            acc = _accumulators(kind, dtype, per_thread * vec, tpr * rows)
            prefetch = acc is not None and _prefetches(kind, dtype, per_thread * vec, tpr * rows, rows, acc)
        return {"vec": vec, "tpr": tpr, "rows": rows, "mode": "register", "acc": acc, "unroll": per_thread,
                "prefetch": prefetch}
    unroll = 4
    tpr = min(_pow2_ceil(math.ceil(nv / unroll)), MAX_THREADS)
    return {"vec": vec, "tpr": tpr, "rows": max(1, BLOCK_THREADS // tpr), "mode": "streamed", "acc": "global",
            "unroll": unroll}


def blocks_per_sm(kind: str, dtype: torch.dtype, config: dict) -> int:
    """Blocks of the row kernel an SM holds at once, from its thread and register budget and,
    where the column sums are in shared memory, its shared-memory budget."""
    threads = config["tpr"] * config["rows"]
    fit = THREADS_PER_SM // threads
    if config["mode"] == "register":
        columns = config["unroll"] * config["vec"]
        registers = _registers(kind, dtype, columns, config["acc"], config["prefetch"])
        fit = min(fit, REGISTER_FILE // (threads * registers))
        if config["acc"] == "shared":
            fit = min(fit, 2 * _SHARED_ACCUMULATOR_BYTES // (parts_of(kind) * columns * threads * 4))
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
    resident = sm_count * blocks_per_sm(kind, dtype, config)
    # ... but never fewer blocks than SMs where the rows allow: an SM without one idles its share
    # of the bandwidth (H200, 2048 x 4096 fp16 layer_norm: 94 slots of 22 rows left 38 SMs idle).
    blocks = min(resident, max(sm_count, math.ceil(m / (per_block * min_rows_per_slot))), math.ceil(m / per_block))
    return max(1, blocks) * per_block


def make_program(kind, n, dtype, has_weight, *, vec, tpr, rows, mode, acc, unroll, prefetch=False):
    """The row kernel's PrimFunc for one configuration (see ``launch_config``)."""
    if n % vec or tpr & (tpr - 1) or tpr * rows > MAX_THREADS or (prefetch and mode != "register"):
        raise ValueError(f"bad launch configuration vec={vec} tpr={tpr} rows={rows} mode={mode} prefetch={prefetch} for N={n}")
    import tilelang.language as T

    fused, layer, parts = kind.startswith("add_"), kind.endswith("layer_norm"), parts_of(kind)
    dt, f32 = _TL_DTYPES[dtype], "float32"
    threads, nv = tpr * rows, n // vec
    cached = mode == "register"
    step = unroll  # vectors per thread in one step: all of them in the register mode
    steps = 1 if cached else math.ceil(nv / (tpr * unroll))
    warps = max(1, tpr // 32)
    lanes = T.vectorized if vec > 1 else T.serial
    wide = min(vec, 4)  # float32 partials move in 16-byte pieces
    part_list = list(range(parts))  # a Python list: unrolled as the program is built
    m, s = T.dynamic("m"), T.dynamic("s")
    absent = 0  # a non-buffer annotation: the parameter is left out of the kernel's signature
    dy_t, x_t, dx_t = T.Tensor((m, n), dt), T.Tensor((m, n), dt), T.Tensor((m, n), dt)
    dr_t = T.Tensor((m, n), dt) if fused else absent
    w_t = T.Tensor((n,), dt) if has_weight else absent
    mean_t = T.Tensor((m,), f32) if layer else absent
    rstd_t, p_t = T.Tensor((m,), f32), T.Tensor((parts, s, n), f32)

    def f(e):
        return T.cast(e, f32)

    def at(p, u, v, tx):
        """Where a thread's column sum p of element v of its vector u is (register mode)."""
        return (p * step * threads + u * threads + tx) * vec + v if acc == "shared" else (p * step + u) * vec + v

    @T.macro
    def row_sums(acc_, red, tx):
        """acc_[0:parts] summed over each row's threads (shuffles, then shared memory)."""
        if tpr <= 32:
            for i in part_list:
                for off in [1 << k for k in reversed(range(tpr.bit_length() - 1))]:
                    acc_[i] = acc_[i] + T.shfl_xor(acc_[i], off)
        else:
            for i in part_list:
                acc_[i] = T.warp_reduce_sum(acc_[i])
                if tx % 32 == 0:
                    red[(i * rows + tx // tpr) * warps + (tx % tpr) // 32] = acc_[i]
            T.sync_threads()
            for i in part_list:
                acc_[i] = f(0)
                for k in T.unroll(warps):
                    acc_[i] = acc_[i] + red[(i * rows + tx // tpr) * warps + k]
            T.sync_threads()  # red is written again for the next row

    @T.macro
    def load_row(r, lane, pairs):
        """A thread's vectors of row r of each (tensor, buffer) of ``pairs``, all of them
        (register mode), the tensors' loads of a vector side by side. (The pairs are indexed,
        not unpacked: TileLang's builder would name the kernel's parameters after the names.)"""
        for u in T.unroll(step):
            if u * tpr + lane < nv:
                for pair in pairs:
                    for v in lanes(vec):
                        pair[1][u * vec + v] = pair[0][r, (u * tpr + lane) * vec + v]

    @T.prim_func
    def main(dy: dy_t, dr: dr_t, x: x_t, w: w_t, mean: mean_t, rstd: rstd_t, dx: dx_t, partial: p_t):
        with T.Kernel(T.ceildiv(s, rows), threads=threads) as bx:
            tx = T.get_thread_binding()
            lane = tx % tpr
            slot = bx * rows + tx // tpr
            xb = T.alloc_local((step * vec,), dt)
            gb = T.alloc_local((step * vec,), dt)
            if prefetch:  # the next row's x and dy, loaded while this one is reduced and written
                xn = T.alloc_local((step * vec,), dt)
                gn = T.alloc_local((step * vec,), dt)
            wb = T.alloc_local((step * vec,), dt)  # weight
            early_dr = fused and prefetch  # the row's dresidual_sum, loaded before its reduction
            if early_dr:
                rb = T.alloc_local((step * vec,), dt)
            if acc == "shared":
                sums = T.alloc_shared((parts * step * threads * vec,), f32)
            else:
                sums = T.alloc_local((parts * step * vec,), f32)
            red = T.alloc_shared((parts * rows * warps,), f32)
            tot = T.alloc_local((2,), f32)
            mu = T.alloc_local((1,), f32)
            rs = T.alloc_local((1,), f32)


            if cached:
                for p in part_list:
                    for u in T.unroll(step):
                        for v in T.unroll(vec):
                            sums[at(p, u, v, tx)] = f(0)
            else:  # each slot owns its partial row: zero its columns
                for st in T.serial(steps):
                    for u in T.unroll(step):
                        vi = (st * step + u) * tpr + lane
                        if vi < nv:
                            for p in part_list:
                                for h in T.unroll(vec // wide):
                                    for v in lanes(wide):
                                        partial[p, slot, vi * vec + h * wide + v] = f(0)
            if cached and has_weight:  # the weight of the thread's columns, for every row
                for u in T.unroll(step):
                    if u * tpr + lane < nv:
                        for v in lanes(vec):
                            wb[u * vec + v] = w[(u * tpr + lane) * vec + v]
            if prefetch:
                load_row(T.min(slot, m - 1), lane, [(x, xb), (dy, gb)])
            for k in T.serial(T.ceildiv(m, s)):
                row = slot + k * s
                src = T.min(row, m - 1)  # past the last row: read a valid row, store nothing
                mu[0] = mean[src] if layer else f(0)
                rs[0] = rstd[src]
                if prefetch:  # this row was loaded ahead; load the next
                    if row + s < m:
                        load_row(row + s, lane, [(x, xn), (dy, gn)])
                    if early_dr and row < m:
                        load_row(row, lane, [(dr, rb)])
                elif cached:
                    load_row(src, lane, [(x, xb), (dy, gb)])
                tot[0] = f(0)
                tot[1] = f(0)
                for st in T.serial(steps):
                    if not cached:  # the streamed mode loads a step's vectors (and weight) at a time
                        for u in T.unroll(step):
                            vi = (st * step + u) * tpr + lane
                            if vi < nv:
                                for v in lanes(vec):
                                    xb[u * vec + v] = x[src, vi * vec + v]
                                for v in lanes(vec):
                                    gb[u * vec + v] = dy[src, vi * vec + v]
                                if has_weight:
                                    for v in lanes(vec):
                                        wb[u * vec + v] = w[vi * vec + v]
                    for u in T.unroll(step):
                        vi = (st * step + u) * tpr + lane
                        if vi < nv:
                            for v in T.unroll(vec):
                                xh = (f(xb[u * vec + v]) - mu[0]) * rs[0]
                                g = f(gb[u * vec + v]) * f(wb[u * vec + v]) if has_weight else f(gb[u * vec + v])
                                tot[0] = tot[0] + g * xh
                                if layer:
                                    tot[1] = tot[1] + g
                            if row < m:
                                if cached:
                                    for v in T.unroll(vec):
                                        xh = (f(xb[u * vec + v]) - mu[0]) * rs[0]
                                        sums[at(0, u, v, tx)] = sums[at(0, u, v, tx)] + f(gb[u * vec + v]) * xh
                                        if layer:
                                            sums[at(1, u, v, tx)] = sums[at(1, u, v, tx)] + f(gb[u * vec + v])
                                else:
                                    for h in T.unroll(vec // wide):
                                        for v in lanes(wide):
                                            c, e = vi * vec + h * wide + v, u * vec + h * wide + v
                                            partial[0, slot, c] = partial[0, slot, c] + f(gb[e]) * (
                                                (f(xb[e]) - mu[0]) * rs[0])
                                            if layer:
                                                partial[1, slot, c] = partial[1, slot, c] + f(gb[e])
                row_sums(tot, red, tx)
                c1 = tot[0] * (1.0 / n)
                c2 = tot[1] * (1.0 / n)
                if row < m:
                    for st in T.serial(steps):
                        for u in T.unroll(step):
                            vi = (st * step + u) * tpr + lane
                            if vi < nv:
                                if not cached:
                                    for v in lanes(vec):
                                        xb[u * vec + v] = x[row, vi * vec + v]
                                    for v in lanes(vec):
                                        gb[u * vec + v] = dy[row, vi * vec + v]
                                    if has_weight:
                                        for v in lanes(vec):
                                            wb[u * vec + v] = w[vi * vec + v]
                                for v in lanes(vec):
                                    col = vi * vec + v
                                    xh = (f(xb[u * vec + v]) - mu[0]) * rs[0]
                                    g = f(gb[u * vec + v]) * f(wb[u * vec + v]) if has_weight else f(gb[u * vec + v])
                                    d = (g - c2 - xh * c1) * rs[0] if layer else (g - xh * c1) * rs[0]
                                    if early_dr:
                                        dx[row, col] = T.cast(d + f(rb[u * vec + v]), dt)
                                    elif fused:
                                        dx[row, col] = T.cast(d + f(dr[row, col]), dt)
                                    else:
                                        dx[row, col] = T.cast(d, dt)
                if prefetch:
                    for e in T.unroll(step * vec):
                        xb[e] = xn[e]
                        gb[e] = gn[e]
            if cached:
                for u in T.unroll(step):
                    vi = u * tpr + lane
                    if vi < nv:
                        for p in part_list:
                            for h in T.unroll(vec // wide):
                                for v in lanes(wide):
                                    partial[p, slot, vi * vec + h * wide + v] = sums[at(p, u, h * wide + v, tx)]

    return main


def make_reduce_program(n, dtype, parts, *, columns=32, lanes=8):
    """The reduce kernel: (parts, S, n) float32 partials summed over S, cast to the dtype.
    A block of ``columns`` x ``lanes`` threads sums ``columns`` adjacent columns (coalesced
    128-byte rows of partials), each lane a stride of the slots, then the lanes in shared memory."""
    import tilelang.language as T

    dt, f32 = _TL_DTYPES[dtype], "float32"
    s = T.dynamic("s")
    p_t, dw_t = T.Tensor((parts, s, n), f32), T.Tensor((n,), dt)
    db_t = T.Tensor((n,), dt) if parts == 2 else 0
    part_list = list(range(parts))

    @T.prim_func
    def main(partial: p_t, dw: dw_t, db: db_t):
        with T.Kernel(T.ceildiv(n, columns), threads=columns * lanes) as bx:
            tx = T.get_thread_binding()
            c, r = tx % columns, tx // columns
            col = T.min(bx * columns + c, n - 1)
            red = T.alloc_shared((parts * lanes * columns,), f32)
            acc = T.alloc_local((parts,), f32)
            for p in part_list:
                acc[p] = T.cast(0, f32)
            for i in T.serial(T.ceildiv(s, lanes)):
                if i * lanes + r < s:
                    for p in part_list:
                        acc[p] = acc[p] + partial[p, i * lanes + r, col]
            for p in part_list:
                red[(p * lanes + r) * columns + c] = acc[p]
            T.sync_threads()
            if r == 0:
                if bx * columns + c < n:
                    for p in part_list:
                        for k in T.unroll(lanes - 1):
                            acc[p] = acc[p] + red[(p * lanes + k + 1) * columns + c]
                    dw[col] = T.cast(acc[0], dt)
                    if parts == 2:
                        db[col] = T.cast(acc[1], dt)

    return main


def compile_row_kernel(kind, n, dtype, has_weight, target, **config):
    """The row kernel of one configuration for a TileLang target, once per process."""
    identity = ("norm_bwd", kind, n, dtype, bool(has_weight), tuple(sorted(config.items())))
    return compile_once(identity, lambda: make_program(kind, n, dtype, has_weight, **config), target)


def compile_reduce_kernel(n, dtype, parts, target):
    """The reduce kernel of (n, dtype, parts) for a TileLang target, once per process."""
    return compile_once(("norm_bwd_reduce", n, dtype, parts), lambda: make_reduce_program(n, dtype, parts), target)
