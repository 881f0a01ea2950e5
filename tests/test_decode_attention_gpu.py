"""GPU tier: DecodeAttentionFwdOp's TileLang kernels on CUDA against the float32 reference and an
explicit SDPA per sequence: every manifest workload; contiguous and paged caches (pages of 16 and
256) with NaN past every length, in the spare pages and where a key mask hides a position,
positions first and heads first (transformers' layout); lengths of 0, 1, a tile's multiple and not; several causal new tokens,
some seeing nothing; head sizes 64, 128 and 256; GQA 32/8 and 64/8, MQA and MHA; the split and
the unsplit launch; whole tiles in a pipeline (Hopper, no key mask, pages of a multiple of 64)
and guarded loads; clamped lengths; a q sliced from a fused qkv projection; the plain-torch
fallback (caches off the 16-byte grid too); torch.compile(fullgraph=True); and decode loops captured in a CUDA graph and replayed
with growing lengths (contiguous and paged caches).

They need a CUDA GPU (``pytest -m gpu``, or ``tools/gpu-tier.sh``); elsewhere they skip.
"""

from __future__ import annotations

import math

import pytest
import torch

from test_decode_attention_ops import (
    assert_matches, heads_first, hide_with_nan, make_call, padding_mask, per_sequence_reference,
)
from tileops.ops import FAMILIES, DecodeAttentionFwdOp
from tileops.kernels.cuda.attention import decode_policy
from tileops.ops.attention.decode_cpu import decode_attention
from helpers import off_the_grid, workload_params
from tileops.testing import check_workload, workload_cases

pytestmark = pytest.mark.gpu

CASES = [case for case in workload_cases(FAMILIES["attention"]) if case.op_class is DecodeAttentionFwdOp]
#: Workloads whose inputs hold more elements than this allocate GiBs with their float32 reference.
LARGE = 1 << 28
TOLERANCE = {torch.bfloat16: 1.6e-2, torch.float16: 2e-3, torch.float32: 1e-5}


def _served_by(op) -> set[str]:
    return {key for key, _ in op.built_kernels()}


def _kernel(op):
    ((_, kernel),) = op.built_kernels()
    return kernel


def _pipelined(page_size) -> bool:
    """Whether an unmasked call's tiles are copied whole in a pipeline on this GPU: on Hopper, from
    a contiguous cache or pages of whole tiles (decode_policy.stages)."""
    return torch.cuda.get_device_capability() == (9, 0) and not (page_size or 0) % decode_policy.BLOCK_N


@pytest.mark.parametrize("case", workload_params(CASES, large=LARGE))
def test_every_workload_matches_the_reference_on_cuda(case):
    op = case.op_class(**case.workload.params)
    check_workload(op, case.workload, case.dtype, "cuda")
    check_workload(op, case.workload, case.dtype, "cuda", seed=1)
    expected = {"tilelang"} if case.dtype in (torch.float16, torch.bfloat16) else {"torch_cuda"}
    assert _served_by(op) == expected


# The longest cache is long enough to be split for every head layout below, 64 query rows of 256
# columns (8 new tokens of 8 query heads per kv head) included, whose splits carry 160 KiB of q and
# float32 partial results each (decode_policy.split_bytes).
LENGTHS = [0, 1, 63, 64, 65, 1000, 8193]


@pytest.mark.parametrize("page_size", [None, 16, 256], ids=lambda p: "contiguous" if p is None else f"paged-{p}")
@pytest.mark.parametrize(
    ("heads_q", "heads_kv", "new_tokens", "head_dim"),
    [(32, 8, 1, 128), (64, 8, 1, 128), (32, 8, 4, 128), (8, 1, 2, 64), (16, 16, 1, 256), (64, 8, 8, 256)],
    ids=str,
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_matches_sdpa_per_sequence_with_nan_past_every_length(page_size, heads_q, heads_kv, new_tokens, head_dim, dtype):
    call = make_call(LENGTHS, new_tokens, heads_q, heads_kv, head_dim, page_size=page_size, dtype=dtype, device="cuda")
    op = DecodeAttentionFwdOp()
    o, lse = op(*call)
    assert _served_by(op) == {"tilelang"}
    assert (_kernel(op).config["stages"] > 0) == _pipelined(page_size)  # pages of 16: guarded loads
    assert o.dtype == dtype and lse.dtype == torch.float32 and lse.shape == (len(LENGTHS), heads_q, new_tokens)
    assert_matches(o, lse, per_sequence_reference(*call[:3], LENGTHS, call[4]), TOLERANCE[dtype])
    # While twice the call's blocks (a sequence and kv head each) fit in one wave of the blocks the
    # GPU holds, the call is split (16 kv heads of D 256 at one block a multiprocessor may not be).
    wave = torch.cuda.get_device_properties(0).multi_processor_count * _kernel(op).config["blocks_per_sm"]
    if 2 * len(LENGTHS) * heads_kv <= wave:
        capacity = call[1].shape[1] * (1 if call[4] is None else call[4].shape[1])
        assert _kernel(op).splits_for(len(LENGTHS), capacity) > 1


@pytest.mark.parametrize("page_size", [None, 16], ids=lambda p: "contiguous" if p is None else f"paged-{p}")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_heads_first_caches_match_sdpa_per_sequence_with_nan_past_every_length(page_size, dtype):
    call = make_call(LENGTHS, 2, 32, 8, 128, page_size=page_size, dtype=dtype, device="cuda")
    op = DecodeAttentionFwdOp(cache_layout="bhsd")
    o, lse = op(*heads_first(call))
    assert _served_by(op) == {"tilelang"}
    assert (_kernel(op).config["stages"] > 0) == _pipelined(page_size)
    assert_matches(o, lse, per_sequence_reference(*call[:3], LENGTHS, call[4]), TOLERANCE[dtype])


@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
@pytest.mark.parametrize("page_size", [None, 16], ids=lambda p: "contiguous" if p is None else f"paged-{p}")
def test_a_key_mask_hides_positions_and_the_nan_the_cache_holds_there(layout, page_size):
    call = make_call(LENGTHS, 1, 32, 8, 128, page_size=page_size, dtype=torch.bfloat16, device="cuda")
    mask = padding_mask(LENGTHS, 4000).cuda()  # hides the tail of the 8193 positions too
    hide_with_nan(call, LENGTHS, mask)
    op = DecodeAttentionFwdOp(cache_layout=layout)
    o, lse = op(*(call if layout == "bshd" else heads_first(call)), key_mask=mask)
    assert _served_by(op) == {"tilelang"}
    assert _kernel(op).config["stages"] == 0  # a key mask keeps the guarded loads
    assert_matches(o, lse, per_sequence_reference(*call[:3], LENGTHS, call[4], key_mask=mask), TOLERANCE[torch.bfloat16])


@pytest.mark.parametrize("scale", [None, 0.05])
def test_without_causal_and_with_a_scale(scale):
    lengths = [5, 700, 1]
    call = make_call(lengths, 3, 32, 8, 128, dtype=torch.bfloat16, device="cuda")
    o, lse = DecodeAttentionFwdOp(scale=scale, causal=False)(*call)
    assert_matches(o, lse, per_sequence_reference(*call[:3], lengths, None, scale=scale, causal=False), 1.6e-2)


def test_rows_that_see_nothing_are_exactly_zero_with_lse_minus_infinity():
    # Sequence 0 is empty; in sequence 1 (length 2) the first two of 4 causal new tokens see nothing.
    call = make_call([0, 2, 3000], 4, 32, 8, 128, dtype=torch.bfloat16, device="cuda")
    o, lse = DecodeAttentionFwdOp()(*call)
    assert torch.equal(o[0], torch.zeros_like(o[0])) and torch.equal(o[1, :2], torch.zeros_like(o[1, :2]))
    assert torch.isneginf(lse[0]).all() and torch.isneginf(lse[1, :, :2]).all()
    assert torch.isfinite(lse[1, :, 2:]).all() and torch.isfinite(o[2]).all() and torch.isfinite(lse[2]).all()


def test_a_batch_that_fills_the_gpu_runs_unsplit_and_matches_the_torch_implementation():
    generator = torch.Generator().manual_seed(3)
    lengths = torch.randint(0, 2049, (192,), generator=generator).tolist()
    call = make_call(lengths, 1, 32, 8, 128, dtype=torch.bfloat16, device="cuda", capacity=2048, garbage=0.0)
    op = DecodeAttentionFwdOp()
    o, lse = op(*call)
    assert _kernel(op).splits_for(192, 2048) == 1
    o_ref, lse_ref = decode_attention(*(t.float() if t.is_floating_point() else t for t in call[:4]), None, None, 128**-0.5, True,
                                      "bshd")
    torch.testing.assert_close(o.float(), o_ref, atol=1.6e-2, rtol=1.6e-2)
    torch.testing.assert_close(lse, lse_ref, atol=1e-3, rtol=1e-3)


def test_a_long_cache_of_one_sequence_is_split_many_ways_and_merged_right():
    call = make_call([131072 - 17], 1, 64, 8, 128, dtype=torch.bfloat16, device="cuda", capacity=131072, garbage=0.0)
    op = DecodeAttentionFwdOp()
    o, lse = op(*call)
    assert _kernel(op).splits_for(1, 131072) > 8
    o_ref, lse_ref = decode_attention(*(t.float() if t.is_floating_point() else t for t in call[:4]), None, None, 128**-0.5, True,
                                      "bshd")
    torch.testing.assert_close(o.float(), o_ref, atol=1.6e-2, rtol=1.6e-2)
    torch.testing.assert_close(lse, lse_ref, atol=1e-3, rtol=1e-3)


def test_lengths_past_the_capacity_are_clamped_and_negative_ones_are_empty():
    q, k_cache, v_cache, _, _ = make_call([300, 300], 1, 32, 8, 128, dtype=torch.bfloat16, device="cuda", capacity=300)
    op = DecodeAttentionFwdOp()
    full = op(q, k_cache, v_cache, torch.tensor([300, 300], dtype=torch.int32, device="cuda"))
    clamped = op(q, k_cache, v_cache, torch.tensor([301, 1 << 30], dtype=torch.int32, device="cuda"))
    assert all(torch.equal(a, b) for a, b in zip(full, clamped))
    o, lse = op(q, k_cache, v_cache, torch.tensor([-5, 0], dtype=torch.int32, device="cuda"))
    assert torch.equal(o, torch.zeros_like(o)) and torch.isneginf(lse).all()


def test_caches_off_the_16_byte_grid_are_served_by_the_plain_torch_implementation():
    # The TileLang kernels' loads are 16-byte vectors, the guarded ones too: such an address faults.
    call = make_call(LENGTHS, 1, 32, 8, 128, dtype=torch.bfloat16, device="cuda")
    shifted = [off_the_grid(cache) for cache in call[1:3]]  # the same values, 2 bytes past an aligned address
    op = DecodeAttentionFwdOp()
    o, lse = op(call[0], *shifted, call[3])
    assert _served_by(op) == {"torch_cuda"}
    assert_matches(o, lse, per_sequence_reference(*call[:3], LENGTHS, None), TOLERANCE[torch.bfloat16])


def test_a_q_sliced_from_a_fused_qkv_projection_gives_the_same_result():
    heads_q, heads_kv, dim = 32, 8, 128
    _, k_cache, v_cache, seqlens, _ = make_call([70, 900], 1, heads_q, heads_kv, dim, dtype=torch.bfloat16, device="cuda")
    qkv = torch.randn(2, 1, (heads_q + 2 * heads_kv) * dim, dtype=torch.bfloat16, device="cuda")
    q = qkv[..., : heads_q * dim].unflatten(-1, (heads_q, dim))
    op = DecodeAttentionFwdOp()
    got, want = op(q, k_cache, v_cache, seqlens), op(q.contiguous(), k_cache, v_cache, seqlens)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_float32_and_odd_head_sizes_are_served_by_the_plain_torch_implementation():
    for dtype, head_dim in [(torch.float32, 128), (torch.bfloat16, 80)]:
        call = make_call([1, 77], 2, 8, 2, head_dim, dtype=dtype, device="cuda")
        op = DecodeAttentionFwdOp()
        o, lse = op(*call)
        assert _served_by(op) == {"torch_cuda"}
        assert_matches(o, lse, per_sequence_reference(*call[:3], [1, 77], None), TOLERANCE[dtype])


def test_compiles_in_one_graph_with_the_tilelang_kernel():
    op = DecodeAttentionFwdOp()
    call = make_call([3, 1000], 1, 32, 8, 128, page_size=16, dtype=torch.bfloat16, device="cuda")
    want = op(*call)
    compiled = torch.compile(lambda *args: op(*args), fullgraph=True)
    got = compiled(*call)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("page_size", [None, 16, 256], ids=lambda p: "contiguous" if p is None else f"paged-{p}")
def test_a_decode_loop_captured_in_a_cuda_graph_is_right_at_every_replay(page_size):
    # One decode step, captured once: write the new token's key and value at position
    # cache_seqlens[b] of each sequence, count it, attend. Each replay is the next step, with new
    # q, k and v; the lengths grow on the device and cross tile, page and split boundaries.
    batch, heads_q, heads_kv, dim, dtype, steps = 4, 32, 8, 128, torch.bfloat16, 70
    start = [0, 1, 62, 1000]
    capacity = max(start) + steps + 3
    if page_size is None:
        _, k_cache, v_cache, _, table = make_call(start, 1, heads_q, heads_kv, dim, dtype=dtype, device="cuda", capacity=capacity)
    else:
        # A pool with room for every sequence to grow: pages assigned up front, shuffled.
        max_pages = math.ceil(capacity / page_size)
        order = torch.randperm(batch * max_pages + 5, generator=torch.Generator().manual_seed(0))
        pool = order.numel()
        k_cache = torch.randn(pool, page_size, heads_kv, dim, dtype=dtype, device="cuda")
        v_cache = torch.randn_like(k_cache)
        table = order[: batch * max_pages].view(batch, max_pages).int().cuda()
    seqlens = torch.tensor(start, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, 1, heads_q, dim, dtype=dtype, device="cuda")
    k_new, v_new = (torch.randn(batch, heads_kv, dim, dtype=dtype, device="cuda") for _ in range(2))
    rows = torch.arange(batch, device="cuda")
    op = DecodeAttentionFwdOp()

    def step():
        position = seqlens.long()
        if table is None:
            k_cache[rows, position] = k_new
            v_cache[rows, position] = v_new
        else:
            page = table[rows, position // page_size].long()
            k_cache[page, position % page_size] = k_new
            v_cache[page, position % page_size] = v_new
        seqlens.add_(1)
        return op(q, k_cache, v_cache, seqlens, table)

    def expected():
        keys, values = k_cache.float(), v_cache.float()
        return decode_attention(q.float(), keys, values, seqlens, table, None, dim**-0.5, True, "bshd")

    # Warm up on a side stream (selects and builds the kernel, and the indexing ops' state), then
    # restore the state the warm-up step changed.
    saved = (k_cache.clone(), v_cache.clone(), seqlens.clone())
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    for tensor, before in zip((k_cache, v_cache, seqlens), saved):
        tensor.copy_(before)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o, lse = step()
    torch.cuda.synchronize()
    assert torch.equal(seqlens, saved[2])  # capturing ran nothing
    for replay in range(steps):
        for tensor in (q, k_new, v_new):
            tensor.copy_(torch.randn_like(tensor))
        graph.replay()
        torch.cuda.synchronize()
        assert seqlens.tolist() == [n + replay + 1 for n in start]
        o_ref, lse_ref = expected()
        torch.testing.assert_close(o.float(), o_ref, atol=1.6e-2, rtol=1.6e-2, msg=lambda m, replay=replay: f"replay {replay}: {m}")
        torch.testing.assert_close(lse, lse_ref, atol=1e-3, rtol=1e-3, msg=lambda m, replay=replay: f"replay {replay}: {m}")
