"""DecodeAttentionFwdOp on the CPU: every small manifest workload against the reference; against
an explicit scaled-dot-product attention per sequence (contiguous and paged caches with pages of
16 and 256, GQA and MQA, one and several new tokens, causal or not, lengths of 0, 1, a tile's
multiple and not); what clamping the lengths and the block table means; garbage past the lengths;
a q sliced from a fused qkv projection; the call spec; torch.compile; bad calls.

``make_call`` and ``per_sequence_reference`` serve the GPU tier too (``test_decode_attention_gpu``).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tileops.backend import OpArgumentError
from tileops.ops import FAMILIES, DecodeAttentionFwdOp
from tileops.ops.attention import DecodeAttentionFwdInterface
from tileops.testing import check_workload, workload_cases

#: The CPU tier runs workloads up to this many elements in all; larger ones run in the GPU tier.
CPU_ELEMENTS = 1 << 22

CASES = [
    case for case in workload_cases(FAMILIES["attention"])
    if case.op_class is DecodeAttentionFwdOp and case.elements <= CPU_ELEMENTS
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_every_small_workload_matches_the_reference(case):
    op = case.op_class(**case.workload.params)
    check_workload(op, case.workload, case.dtype, "cpu")


# -- the explicit reference ------------------------------------------------------------------------


def make_call(
    lengths, new_tokens, heads_q, heads_kv, head_dim, *, page_size=None, dtype=torch.float32, device="cpu",
    capacity=None, garbage=float("nan"), seed=0,
):
    """(q, k_cache, v_cache, cache_seqlens, block_table) of a decode call: B = len(lengths)
    sequences. Contiguous caches (page_size None) hold ``capacity`` positions (default: the
    longest length plus 5); a paged pool holds each sequence's pages at shuffled places, with
    spare pages and unused block-table entries. Every cache position past its sequence's length
    (and every spare page) holds ``garbage``."""
    generator = torch.Generator().manual_seed(seed)
    batch = len(lengths)

    def normal(*shape):
        return torch.randn(shape, generator=generator).to(dtype)

    q = normal(batch, new_tokens, heads_q, head_dim)
    if page_size is None:
        capacity = max(lengths, default=0) + 5 if capacity is None else capacity
        k_cache, v_cache = normal(batch, capacity, heads_kv, head_dim), normal(batch, capacity, heads_kv, head_dim)
        for b, n in enumerate(lengths):
            k_cache[b, n:] = garbage
            v_cache[b, n:] = garbage
        block_table = None
    else:
        max_pages = max(math.ceil(n / page_size) for n in lengths) + 1
        pool = batch * max_pages + 3
        order = torch.randperm(pool, generator=generator)
        k_cache = torch.full((pool, page_size, heads_kv, head_dim), garbage).to(dtype)
        v_cache = torch.full((pool, page_size, heads_kv, head_dim), garbage).to(dtype)
        block_table = torch.full((batch, max_pages), 7 * pool, dtype=torch.int32)  # unused entries: out of the pool
        for b, n in enumerate(lengths):
            pages = order[b * max_pages: b * max_pages + math.ceil(n / page_size)]
            block_table[b, : len(pages)] = pages.int()
            keys, values = normal(n, heads_kv, head_dim), normal(n, heads_kv, head_dim)
            for i, page in enumerate(pages.tolist()):
                rows = slice(i * page_size, min((i + 1) * page_size, n))
                k_cache[page, : rows.stop - rows.start] = keys[rows]
                v_cache[page, : rows.stop - rows.start] = values[rows]
        block_table = block_table.to(device)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=device)
    return q.to(device), k_cache.to(device), v_cache.to(device), seqlens, block_table


def per_sequence_reference(q, k_cache, v_cache, lengths, block_table, *, scale=None, causal=True, key_mask=None):
    """(o, lse) in float64, one sequence at a time: its first ``lengths[b]`` positions gathered
    (through the block table where paged) and handed to ``F.scaled_dot_product_attention`` with
    the new tokens' causal mask (and the positions ``key_mask`` shows); the log-sum-exp written
    out; a row that sees nothing is 0, -inf."""
    batch, new, heads_q, head_dim = q.shape
    heads_kv = k_cache.shape[2]
    scale = head_dim**-0.5 if scale is None else scale
    outs, lses = [], []
    for b, n in enumerate(lengths):
        if block_table is None:
            keys, values = k_cache[b, :n], v_cache[b, :n]
        else:
            pages = block_table[b, : math.ceil(n / k_cache.shape[1])].long().cpu()
            keys, values = k_cache.cpu()[pages].flatten(0, 1)[:n], v_cache.cpu()[pages].flatten(0, 1)[:n]
        keys = keys.cpu().double().repeat_interleave(heads_q // heads_kv, 1).transpose(0, 1)  # (Hq, n, D)
        values = values.cpu().double().repeat_interleave(heads_q // heads_kv, 1).transpose(0, 1)
        query = q[b].cpu().double().transpose(0, 1)  # (Hq, S, D)
        positions = torch.arange(n)
        seen = (positions <= n - new + torch.arange(new)[:, None]) if causal else torch.ones(new, n, dtype=torch.bool)
        if key_mask is not None:
            shown = torch.zeros(n, dtype=torch.bool)
            width = min(n, key_mask.shape[1])
            shown[:width] = key_mask[b, :width].cpu()
            seen = seen & shown
            # A hidden position's garbage (NaN) must not reach the reference either.
            keys, values = torch.where(shown[None, :, None], keys, 0), torch.where(shown[None, :, None], values, 0)
        empty = ~seen.any(-1)  # (S,)
        o = F.scaled_dot_product_attention(query, keys, values, attn_mask=seen, scale=scale)
        o = torch.where(empty[:, None], 0.0, o)
        scores = (query @ keys.transpose(-1, -2) * scale).masked_fill(~seen, float("-inf"))
        outs.append(o.transpose(0, 1))
        lses.append(torch.logsumexp(scores, -1))
    return torch.stack(outs), torch.stack(lses)


def assert_matches(o, lse, reference, tolerance):
    """o within ``tolerance`` of the reference, lse too or within float32's rounding (lse is float32)."""
    o_ref, lse_ref = reference
    torch.testing.assert_close(o.cpu().double(), o_ref, atol=tolerance, rtol=tolerance)
    lse_tolerance = max(tolerance, 1e-6)
    torch.testing.assert_close(lse.cpu().double(), lse_ref, atol=lse_tolerance, rtol=lse_tolerance)


@pytest.mark.parametrize("page_size", [None, 16, 256], ids=lambda p: "contiguous" if p is None else f"paged-{p}")
@pytest.mark.parametrize(("heads_q", "heads_kv", "new_tokens"), [(8, 2, 1), (8, 2, 3), (4, 1, 2), (6, 6, 1)], ids=str)
def test_matches_sdpa_per_sequence(page_size, heads_q, heads_kv, new_tokens):
    lengths = [0, 1, 2, 64, 300, 513]
    call = make_call(lengths, new_tokens, heads_q, heads_kv, 32, page_size=page_size)
    o, lse = DecodeAttentionFwdOp()(*call)
    assert o.shape == call[0].shape and lse.shape == (len(lengths), heads_q, new_tokens) and lse.dtype == torch.float32
    assert_matches(o, lse, per_sequence_reference(*call[:3], lengths, call[4]), 1e-5)


def heads_first(call):
    """A decode call with its caches in the bhsd layout, (N, Hkv, L, D), as transformers' caches."""
    q, k_cache, v_cache, seqlens, block_table = call
    return q, k_cache.transpose(1, 2).contiguous(), v_cache.transpose(1, 2).contiguous(), seqlens, block_table


@pytest.mark.parametrize("page_size", [None, 16], ids=lambda p: "contiguous" if p is None else f"paged-{p}")
def test_heads_first_caches_give_what_the_same_caches_give_positions_first(page_size):
    lengths = [0, 1, 64, 300]
    call = make_call(lengths, 3, 8, 2, 32, page_size=page_size)
    o, lse = DecodeAttentionFwdOp(cache_layout="bhsd")(*heads_first(call))
    assert_matches(o, lse, per_sequence_reference(*call[:3], lengths, call[4]), 1e-5)
    # The kv heads are the caches' second dimension: 2 of 8 query heads' groups, not 300 positions.
    with pytest.raises(OpArgumentError, match="Hq must be a multiple of the kv heads"):
        DecodeAttentionFwdOp(cache_layout="bhsd")(*call)


def padding_mask(lengths, width, *, seed=0):
    """A key mask (B, width) of left padding (the first ``b % 3`` positions of sequence b hidden)
    and a few other hidden positions, as a padded batch's attention mask has them."""
    generator = torch.Generator().manual_seed(seed)
    mask = torch.rand(len(lengths), width, generator=generator) > 0.1
    for b in range(len(lengths)):
        mask[b, : b % 3] = False
    return mask


def hide_with_nan(call, lengths, mask) -> None:
    """Write NaN into the keys of ``call``'s caches (positions first) where ``mask`` hides a
    position a sequence holds: a hidden position must not be read."""
    _, k_cache, _, _, table = call
    for b, n in enumerate(lengths):
        hidden = (~mask[b, :n].cpu()).nonzero().flatten().to(k_cache.device)
        if table is None:
            k_cache[b, hidden] = float("nan")
        else:
            page_size = k_cache.shape[1]
            k_cache[table[b, hidden // page_size].long(), hidden % page_size] = float("nan")


@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
@pytest.mark.parametrize("page_size", [None, 16], ids=lambda p: "contiguous" if p is None else f"paged-{p}")
@pytest.mark.parametrize("width", [40, 600], ids=["narrower", "wider"])
def test_a_key_mask_hides_positions_and_what_the_cache_holds_there(layout, page_size, width):
    lengths = [0, 1, 2, 64, 300, 513]
    call = make_call(lengths, 2, 8, 2, 32, page_size=page_size)
    mask = padding_mask(lengths, width)
    hide_with_nan(call, lengths, mask)
    given = call if layout == "bshd" else heads_first(call)
    o, lse = DecodeAttentionFwdOp(cache_layout=layout)(*given, key_mask=mask)
    # Positions past the mask's width are hidden: a narrower mask hides the tails of long sequences.
    assert_matches(o, lse, per_sequence_reference(*call[:3], lengths, call[4], key_mask=mask), 1e-5)


@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
@pytest.mark.parametrize(("new_tokens", "causal", "lengths"), [(1, True, [40, 40]), (3, True, [25, 25]), (2, False, [7, 7]), (3, True, [25, 9])])
def test_the_cpu_paths_give_the_math_references_values(layout, new_tokens, causal, lengths):
    # Equal lengths take the dense kernel over the cut caches, others the masked one; past each
    # length the caches hold NaN, which neither may read.
    from tileops.ops.attention.decode_cpu import decode_attention, flash_decode_attention

    torch.manual_seed(0)
    q = torch.randn(2, new_tokens, 8, 16, dtype=torch.float64)
    shape = (2, 48, 2, 16) if layout == "bshd" else (2, 2, 48, 16)
    k_cache, v_cache = torch.randn(shape, dtype=torch.float64), torch.randn(shape, dtype=torch.float64)
    seqlens = torch.tensor(lengths, dtype=torch.int32)
    for cache in (k_cache, v_cache):
        for b, length in enumerate(lengths):
            (cache[b, length:] if layout == "bshd" else cache[b, :, length:]).fill_(float("nan"))
    got = flash_decode_attention(q, k_cache, v_cache, seqlens, None, None, 0.3, causal, layout)
    want = decode_attention(q, k_cache, v_cache, seqlens, None, None, 0.3, causal, layout)
    for mine, math_reference in zip(got, want):
        torch.testing.assert_close(mine, math_reference)


def test_a_cache_layout_other_than_the_two_is_refused_at_construction():
    with pytest.raises(OpArgumentError, match="cache_layout must be 'bshd' or 'bhsd'"):
        DecodeAttentionFwdOp(cache_layout="bsdh")


def test_without_causal_every_new_token_sees_the_whole_sequence_and_the_scale_is_applied():
    lengths = [1, 5, 70]
    call = make_call(lengths, 3, 4, 2, 16)
    o, lse = DecodeAttentionFwdOp(scale=0.3, causal=False)(*call)
    assert_matches(o, lse, per_sequence_reference(*call[:3], lengths, None, scale=0.3, causal=False), 1e-5)


def test_a_row_that_sees_nothing_is_zero_with_lse_minus_infinity():
    # Sequence 0 is empty; in sequence 1 (length 2) the first of 3 new tokens sees no position.
    call = make_call([0, 2], 3, 2, 1, 16)
    o, lse = DecodeAttentionFwdOp()(*call)
    assert torch.equal(o[0], torch.zeros_like(o[0])) and torch.equal(o[1, 0], torch.zeros_like(o[1, 0]))
    assert torch.isneginf(lse[0]).all() and torch.isneginf(lse[1, :, 0]).all() and torch.isfinite(lse[1, :, 1:]).all()


def test_float64_and_16_bit_calls():
    lengths = [3, 40]
    for dtype, tolerance in [(torch.float64, 1e-10), (torch.bfloat16, 1.6e-2), (torch.float16, 2e-3)]:
        call = make_call(lengths, 2, 4, 2, 32, dtype=dtype, garbage=0.0)
        o, lse = DecodeAttentionFwdOp()(*call)
        assert o.dtype == dtype and lse.dtype == torch.float32
        assert_matches(o, lse, per_sequence_reference(*call[:3], lengths, None), tolerance)


def test_lengths_are_clamped_to_the_capacity_and_block_table_entries_to_the_pool():
    q, k_cache, v_cache, _, _ = make_call([10, 10], 1, 4, 2, 16, capacity=10)
    op = DecodeAttentionFwdOp()
    full = op(q, k_cache, v_cache, torch.tensor([10, 10], dtype=torch.int32))
    clamped = op(q, k_cache, v_cache, torch.tensor([11, 1 << 30], dtype=torch.int32))
    assert all(torch.equal(a, b) for a, b in zip(full, clamped))
    empty = op(q, k_cache, v_cache, torch.tensor([-3, 0], dtype=torch.int32))
    assert torch.equal(empty[0], torch.zeros_like(q)) and torch.isneginf(empty[1]).all()
    # Paged: capacity MP * page_size; an entry past the pool reads its last page.
    q, k_cache, v_cache, _, _ = make_call([32], 1, 4, 2, 16, page_size=16)
    table = torch.tensor([[0, k_cache.shape[0] + 5]], dtype=torch.int32)
    reference_table = torch.tensor([[0, k_cache.shape[0] - 1]], dtype=torch.int32)
    got = op(q, k_cache.nan_to_num(), v_cache.nan_to_num(), torch.tensor([1000], dtype=torch.int32), table)
    want = op(q, k_cache.nan_to_num(), v_cache.nan_to_num(), torch.tensor([32], dtype=torch.int32), reference_table)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_a_q_sliced_from_a_fused_qkv_projection_gives_the_same_result():
    heads_q, heads_kv, dim = 8, 2, 32
    lengths = [7, 90]
    _, k_cache, v_cache, seqlens, _ = make_call(lengths, 2, heads_q, heads_kv, dim)
    qkv = torch.randn(2, 2, (heads_q + 2 * heads_kv) * dim)
    q = qkv[..., : heads_q * dim].unflatten(-1, (heads_q, dim))
    assert not q.is_contiguous()
    op = DecodeAttentionFwdOp()
    got = op(q, k_cache, v_cache, seqlens)
    want = op(q.contiguous(), k_cache, v_cache, seqlens)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_keyword_calls_and_the_call_spec():
    call = make_call([5], 1, 4, 2, 16, page_size=16)
    op = DecodeAttentionFwdOp()
    o, lse = op(call[0], call[1], call[2], cache_seqlens=call[3], block_table=call[4])
    assert_matches(o, lse, per_sequence_reference(*call[:3], [5], call[4]), 1e-5)
    from tileops.core.tensor_description import TensorDescription

    def described(tensor):
        return TensorDescription(torch.device("cuda", 0), torch.bfloat16, tuple(tensor.shape), 0)

    inputs = {name: described(t) for name, t in zip(("q", "k_cache", "v_cache", "cache_seqlens", "block_table"), call)}
    spec = op.call_specs(torch.device("cuda", 0), inputs)[DecodeAttentionFwdInterface]
    assert (spec.heads_q, spec.heads_kv, spec.head_dim, spec.new_tokens, spec.page_size) == (4, 2, 16, 1, 16)
    assert spec.scale == 0.25 and spec.causal is True
    assert spec.aligned is True and spec.masked is False
    del inputs["block_table"]
    assert DecodeAttentionFwdOp(scale=0.5).call_specs(torch.device("cuda", 0), inputs)[DecodeAttentionFwdInterface].page_size == 0
    # A cache or a q whose address is off the 16-byte grid (a vector load's cannot be) says so.
    for name in ("v_cache", "q"):
        shifted = dict(inputs)
        shifted[name] = TensorDescription(torch.device("cuda", 0), torch.bfloat16, tuple(inputs[name].shape), 2)
        assert op.call_specs(torch.device("cuda", 0), shifted)[DecodeAttentionFwdInterface].aligned is False


def test_compiles_in_one_graph():
    op = DecodeAttentionFwdOp()
    call = make_call([3, 17], 1, 4, 2, 16, garbage=0.0)
    compiled = torch.compile(lambda *args: op(*args), fullgraph=True, backend="aot_eager")
    got = compiled(*call)
    want = op(*call)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


# -- bad calls -------------------------------------------------------------------------------------


def _call(**changes):
    q, k_cache, v_cache, seqlens, _ = make_call([4, 4], 1, 4, 2, 16, garbage=0.0)
    arguments = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "cache_seqlens": seqlens}
    arguments.update(changes)
    return arguments


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"q": torch.randn(2, 1, 3, 16)}, "query heads Hq must be a multiple of the kv heads Hkv"),
        ({"k_cache": torch.randn(1, 9, 2, 16), "v_cache": torch.randn(1, 9, 2, 16)}, "N >= B"),
        ({"k_cache": torch.randn(2, 9, 2, 8), "v_cache": torch.randn(2, 9, 2, 8)}, "argument 'k_cache' expected shape [N, C1, C2, D]"),
        ({"v_cache": torch.randn(2, 8, 2, 16)}, "argument 'v_cache' must have the shape of 'k_cache' (2, 9, 2, 16), got (2, 8, 2, 16)"),
        ({"cache_seqlens": torch.tensor([4, 4])}, "argument 'cache_seqlens' expected dtype int32, got torch.int64"),
        ({"cache_seqlens": torch.tensor([4], dtype=torch.int32)}, "argument 'cache_seqlens' expected shape [B]"),
        ({"block_table": torch.zeros(2, 1)}, "argument 'block_table' expected dtype int32"),
        ({"block_table": torch.zeros(3, 1, dtype=torch.int32)}, "argument 'block_table' expected shape [B, MP]"),
        ({"k_cache": torch.randn(2, 9, 2, 16, dtype=torch.float64)}, "argument 'k_cache' must have the dtype of 'q' (torch.float32), got torch.float64"),
    ],
    ids=["gqa", "rows", "head-size", "v-shape", "seqlens-dtype", "seqlens-shape", "table-dtype", "table-shape", "cache-dtype"],
)
def test_bad_calls_name_the_argument_what_was_expected_and_what_came(changes, message):
    with pytest.raises(OpArgumentError, match="^DecodeAttentionFwdOp: ") as error:
        DecodeAttentionFwdOp()(**_call(**changes))
    assert message in str(error.value)


def test_a_missing_cache_seqlens_is_refused():
    arguments = _call()
    del arguments["cache_seqlens"]
    with pytest.raises(OpArgumentError, match="cache_seqlens"):
        DecodeAttentionFwdOp()(**arguments)


# -- the bench peers ---------------------------------------------------------------------------------


def test_the_peer_table_names_the_op_and_callables_as_module_attribute():
    from tileops.ops.attention import decode_peers

    assert list(decode_peers.DECODE_PEERS) == ["DecodeAttentionFwdOp"]
    columns = decode_peers.DECODE_PEERS["DecodeAttentionFwdOp"]
    assert list(columns) == ["SDPA flash", "SDPA cuDNN", "SDPA efficient", "flash-attn", "FlashInfer"]
    assert all(reference.count(":") == 1 and callable(adapter) for reference, adapter in columns.values())


def _peer(column):
    from tileops.ops.attention.decode_peers import DECODE_PEERS

    return DECODE_PEERS["DecodeAttentionFwdOp"][column][1]


def _inputs(lengths, page_size=None, new_tokens=1):
    names = ("q", "k_cache", "v_cache", "cache_seqlens", "block_table")
    call = make_call(lengths, new_tokens, 8, 2, 32, page_size=page_size, garbage=0.0)
    return {name: tensor for name, tensor in zip(names, call) if tensor is not None}


def _math_sdpa(*args, **options):
    """SDPA on its math backend, whatever backend the caller pinned."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(*args, **options)


def _heads_first(inputs):
    caches = {name: inputs[name].transpose(1, 2).contiguous() for name in ("k_cache", "v_cache")}
    return {**inputs, **caches}


@pytest.mark.parametrize("page_size", [None, 16], ids=["contiguous", "paged-16"])
@pytest.mark.parametrize("lengths", [[40, 40], [3, 40]], ids=["equal", "unequal"])
def test_the_sdpa_adapter_computes_the_op_with_sdpa_on_the_caches_heads_first(page_size, lengths):
    inputs = _inputs(lengths, page_size)
    call = _peer("SDPA flash")(F.scaled_dot_product_attention, inputs, {"scale": None, "causal": True})
    o, _ = DecodeAttentionFwdOp()(*inputs.values())
    torch.testing.assert_close(call(), o, atol=1e-5, rtol=1e-5)
    heads_first_call = _peer("SDPA flash")(F.scaled_dot_product_attention, _heads_first(inputs), {"cache_layout": "bhsd"})
    torch.testing.assert_close(heads_first_call(), o, atol=1e-5, rtol=1e-5)
    masked = dict(inputs, key_mask=padding_mask(lengths, 30))
    heads = []

    def recorded(q, k, v, **options):  # the backend pinned is CUDA's; this computes on the math one
        heads.append((q.shape[1], k.shape[1], v.shape[1], options["enable_gqa"]))
        return _math_sdpa(q, k, v, **options)

    masked_call = _peer("SDPA efficient")(recorded, masked, {})
    torch.testing.assert_close(masked_call(), DecodeAttentionFwdOp()(*inputs.values(), key_mask=masked["key_mask"])[0],
                               atol=1e-5, rtol=1e-5)
    # The memory-efficient backend takes no grouped heads: K and V come repeated to the 8 query heads.
    assert heads and set(heads) == {(8, 8, 8, False)}
    assert _peer("SDPA flash")(F.scaled_dot_product_attention, masked, {}) == "takes no attention mask"
    refused = _peer("SDPA cuDNN")(F.scaled_dot_product_attention, _inputs([5], new_tokens=2), {"causal": True})
    assert refused == "aligns causal masking to the top left; the op's new tokens are bottom-right aligned"


def test_the_flash_attn_adapter_passes_the_call_as_flash_attn_with_kvcache_takes_it():
    calls = []
    inputs = _inputs([3, 40], 256)
    call = _peer("flash-attn")(lambda *args, **options: calls.append((args, options)), inputs, {"scale": 0.1, "causal": True})
    call()
    ((args, options),) = calls
    assert args == (inputs["q"], inputs["k_cache"], inputs["v_cache"])
    assert options["cache_seqlens"] is inputs["cache_seqlens"] and options["block_table"] is inputs["block_table"]
    assert options["softmax_scale"] == 0.1 and options["causal"] and options["return_softmax_lse"]
    assert "multiple of 256" in _peer("flash-attn")(None, _inputs([3], 16), {})
    assert "(bshd) only" in _peer("flash-attn")(None, _inputs([3], 256), {"cache_layout": "bhsd"})
    assert _peer("flash-attn")(None, dict(inputs, key_mask=padding_mask([3, 40], 40)), {}) == "takes no key mask"


def test_the_flashinfer_adapter_plans_the_page_table_of_the_block_table_and_lengths():
    planned = []

    class Wrapper:
        def __init__(self, workspace, layout, use_tensor_cores):
            assert use_tensor_cores
            self.layout = layout

        def plan(self, indptr, indices, last_page_len, *sizes, **options):
            planned.append((self.layout, indptr.tolist(), indices.tolist(), last_page_len.tolist(), sizes))

        def run(self, q, caches, return_lse):
            return q, q[..., 0]

    inputs = _inputs([3, 40], 16)
    call = _peer("FlashInfer")(Wrapper, inputs, {})
    table = inputs["block_table"]
    ((layout, indptr, indices, last, sizes),) = planned
    assert layout == "NHD" and indptr == [0, 1, 4] and indices == [table[0, 0].item(), *table[1, :3].tolist()]
    assert last == [3, 8] and sizes == (8, 2, 32, 16)
    o, lse = call()
    # Pages heads first are FlashInfer's HND layout: the same table, page size from dimension 2.
    _peer("FlashInfer")(Wrapper, _heads_first(inputs), {"cache_layout": "bhsd"})
    assert planned[1] == ("HND", *planned[0][1:])
    assert o.shape == inputs["q"].shape
    assert "one new token" in _peer("FlashInfer")(Wrapper, _inputs([5], new_tokens=2), {})
