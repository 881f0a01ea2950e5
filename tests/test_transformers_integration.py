"""``tileops.integrations.transformers``: real transformers models, built from tiny configs with
random weights (nothing downloaded), patched with one call and compared with the unpatched
model on the CPU: logits, a training step's loss and gradients, generation with the KV cache,
``torch.compile``, checkpoints and the report."""

from __future__ import annotations

import copy
import inspect
import subprocess
import sys
import warnings

import pytest
import torch
import torch._dynamo.testing

from helpers import load_tool

transformers = pytest.importorskip("transformers")

import tileops.nn  # noqa: E402
from tileops.integrations import transformers as tileops_hf  # noqa: E402

TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 128}
CONFIGS = {
    "llama": transformers.LlamaConfig,
    "mistral": transformers.MistralConfig,
    "qwen2": transformers.Qwen2Config,
    "qwen3": transformers.Qwen3Config,
    "gemma": transformers.GemmaConfig,
}
#: What each architecture's norms become, and how many a 2-layer model has.
NORMS = {
    "llama": ("LlamaRMSNorm", tileops_hf.LlamaRMSNorm, 5),
    "mistral": ("MistralRMSNorm", tileops_hf.LlamaRMSNorm, 5),
    "qwen2": ("Qwen2RMSNorm", tileops_hf.LlamaRMSNorm, 5),
    "qwen3": ("Qwen3RMSNorm", tileops_hf.LlamaRMSNorm, 9),  # with q_norm and k_norm in each layer
    "gemma": ("GemmaRMSNorm", tileops_hf.GemmaRMSNorm, 5),
}
#: Logits and loss. In bfloat16 the op rounds the norm once where transformers rounds it twice
#: (the norm, then its product with the weight): the logits differ by about as much as
#: transformers' own bfloat16 logits differ from its float32 ones.
TOLERANCE = {torch.float32: {"rtol": 1e-4, "atol": 1e-5}, torch.bfloat16: {"rtol": 1.6e-2, "atol": 1e-2}}


def assert_gradients_close(gradient: torch.Tensor, expected: torch.Tensor, name: str) -> None:
    """Within 1e-4 (float32) or 4% (bfloat16) of the largest expected element: a gradient
    crosses the two layers backwards, through every rounding of the forward."""
    scale = expected.abs().max().item()
    share = 1e-4 if expected.dtype == torch.float32 else 0.04
    torch.testing.assert_close(gradient, expected, rtol=share, atol=share * scale, msg=lambda message: f"{name}: {message}")


def tiny_model(architecture: str, dtype: torch.dtype = torch.float32, **overrides) -> torch.nn.Module:
    """A transformers causal LM of ``architecture`` with random weights, its norms' weights moved
    off their initial ones and zeros so that a wrong formula shows."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[architecture](**{**TINY, **overrides}))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.add_(0.2 * torch.randn_like(parameter))
    return model.to(dtype)


def patched_pair(architecture: str, dtype: torch.dtype = torch.float32, **overrides):
    reference = tiny_model(architecture, dtype, **overrides)
    model = copy.deepcopy(reference)
    return reference, model, tileops_hf.apply(model)


def tokens(batch: int = 2, length: int = 12) -> torch.Tensor:
    return torch.randint(0, TINY["vocab_size"], (batch, length), generator=torch.Generator().manual_seed(1))


#: What apply() replaces in each listed architecture besides the norms: per layer, the MLP, the
#: attention module's rotation and its attention function; and the model's loss, twice.
def expected_replacements(architecture: str) -> list[tuple[str, str]]:
    prefix = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3", "gemma": "Gemma"}[architecture]
    original, replacement, count = NORMS[architecture]
    per_layer = [(f"{prefix}MLP", "tileops.nn.GatedMLP"), (f"{prefix}Attention: apply_rotary_pos_emb", "RotaryEmbeddingFwdOp"),
                 (f"{prefix}Attention: sdpa attention", "AttentionFwdOp, DecodeAttentionFwdOp for decode steps (sdpa for other masks and calls no kernel takes)")]
    return sorted([(original, f"tileops.integrations.transformers.{replacement.__name__}")] * count + per_layer * TINY["num_hidden_layers"]
                  + [("ForCausalLMLoss", "CrossEntropyFwdOp"),
                     (f"{prefix}ForCausalLM.forward", "LinearCrossEntropyFwdOp in training with labels (no logits, no KV cache)")])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("architecture", sorted(CONFIGS))
def test_the_patched_model_computes_and_trains_as_the_unpatched_one(architecture, dtype):
    reference, model, report = patched_pair(architecture, dtype)
    assert sorted((r.original, r.replacement) for r in report.replaced) == expected_replacements(architecture)
    assert [(r.kind, r.path) for r in report.left] == [("rotary embedding", "model.rotary_emb")]
    assert all(type(model.get_submodule(r.path)) is NORMS[architecture][1] for r in report.replaced if "RMSNorm" in r.original)
    assert model.config._attn_implementation == "tileops"
    assert model.state_dict().keys() == reference.state_dict().keys()
    ids = tokens()

    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, **TOLERANCE[dtype])
        # In eval mode a loss comes from the logits, through the model's loss_function.
        torch.testing.assert_close(model(ids, labels=ids).loss, reference(ids, labels=ids).loss, **TOLERANCE[dtype])

    model.train()
    reference.train()
    output, output_reference = model(ids, labels=ids), reference(ids, labels=ids)
    assert output.logits is None  # the fused linear cross-entropy never computed them
    torch.testing.assert_close(output.loss, output_reference.loss, **TOLERANCE[dtype])
    output.loss.backward()
    output_reference.loss.backward()
    expected = dict(reference.named_parameters())
    for name, parameter in model.named_parameters():
        assert parameter.grad.dtype == dtype, name
        assert_gradients_close(parameter.grad, expected[name].grad, name)


def test_a_transformers_release_older_than_the_patch_knows_is_refused_with_the_versions(monkeypatch):
    monkeypatch.setattr(tileops_hf, "_transformers_version", lambda: "4.48.3")
    model = tiny_model("llama", torch.float32)
    with pytest.raises(ImportError, match=r"apply needs transformers 4\.57 or later, found 4\.48\.3"):
        tileops_hf.apply(model)
    assert type(model.model.norm).__name__ == "LlamaRMSNorm" and model.config._attn_implementation != "tileops"


def test_the_fused_loss_takes_the_forward_of_earlier_transformers_releases():
    """Earlier releases named the KV cache past_key_values (4.x added cache_position): their
    causal LMs get the fused loss too; a forward taking an input the fused one does not pass on
    keeps its own."""
    from tileops.integrations.transformers.loss import fused_forward_reason

    class NamedPastKeyValues:
        def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None, inputs_embeds=None,
                    labels=None, use_cache=None, logits_to_keep=0, **kwargs): ...

    class WithCachePosition:
        def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None, inputs_embeds=None,
                    labels=None, use_cache=None, cache_position=None, logits_to_keep=0, **kwargs): ...

    class WithPixels:
        def forward(self, input_ids=None, pixel_values=None, labels=None, logits_to_keep=0, **kwargs): ...

    class WithoutKeywords:
        def forward(self, input_ids=None, labels=None, logits_to_keep=0): ...

    # The fused forward shows the class's parameters: generate() reads them (it builds an
    # attention mask only for a forward that takes one).
    _, model, _ = patched_pair("llama")
    assert inspect.signature(model.forward) == inspect.signature(transformers.LlamaForCausalLM(model.config).forward)
    assert fused_forward_reason(NamedPastKeyValues) is None
    assert fused_forward_reason(WithCachePosition) is None
    assert fused_forward_reason(WithPixels) == ("its forward takes ('input_ids', 'pixel_values', 'labels', 'logits_to_keep', "
                                                "'kwargs'), not the ones the fused forward knows")
    assert "not the ones the fused forward knows" in fused_forward_reason(WithoutKeywords)


@pytest.mark.parametrize(
    ("config", "original", "replacement", "count"),
    [("MixtralConfig", "MixtralRMSNorm", tileops_hf.LlamaRMSNorm, 5), ("Gemma3TextConfig", "Gemma3RMSNorm", tileops_hf.GemmaRMSNorm, 13)],
    ids=["mixtral", "gemma3"],
)
def test_the_norms_of_architectures_outside_the_list_are_probed_and_replaced(config, original, replacement, count):
    torch.manual_seed(0)
    reference = transformers.AutoModelForCausalLM.from_config(getattr(transformers, config)(**TINY))
    with torch.no_grad():
        for name, parameter in reference.named_parameters():
            if "norm" in name:
                parameter.add_(0.2 * torch.randn_like(parameter))
    model = copy.deepcopy(reference)
    report = tileops_hf.apply(model)
    norms = [(r.original, r.replacement) for r in report.replaced if r.original.endswith("RMSNorm")]
    assert norms == [(original, f"tileops.integrations.transformers.{replacement.__name__}")] * count
    ids = tokens()
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, **TOLERANCE[torch.float32])


def _outside_pair(config: str, attn_implementation: str | None = None, **overrides):
    """An architecture outside the list, unpatched and patched (its norms' weights moved off their
    initial ones), and the report."""
    torch.manual_seed(0)
    options = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    reference = transformers.AutoModelForCausalLM.from_config(getattr(transformers, config)(**{**TINY, **overrides}), **options)
    with torch.no_grad():
        for name, parameter in reference.named_parameters():
            if "norm" in name:
                parameter.add_(0.2 * torch.randn_like(parameter))
    model = copy.deepcopy(reference)
    return reference, model, tileops_hf.apply(model)


def _assert_computes_and_trains_as(model, reference):
    ids = tokens()
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, **TOLERANCE[torch.float32])
    model.train()
    reference.train()
    output, output_reference = model(ids, labels=ids), reference(ids, labels=ids)
    torch.testing.assert_close(output.loss, output_reference.loss, **TOLERANCE[torch.float32])
    output.loss.backward()
    output_reference.loss.backward()
    expected = dict(reference.named_parameters())
    for name, parameter in model.named_parameters():
        assert_gradients_close(parameter.grad, expected[name].grad, name)


def test_a_rotation_of_pairs_is_recognised_and_a_forward_that_scales_its_logits_keeps_its_loss():
    # Cohere rotates pairs (GPT-J's rotation) under the name Llama uses for halves, and multiplies
    # its logits by logit_scale before the loss: a fused loss would leave the scale out.
    reference, model, report = _outside_pair("CohereConfig", logit_scale=0.5)
    replaced = {r.original: r.replacement for r in report.replaced}
    assert replaced["CohereAttention: apply_rotary_pos_emb"] == "RotaryEmbeddingFwdOp (style=interleaved)"
    left = {(r.kind, r.original): r.reason for r in report.left}
    assert left["loss", "CohereForCausalLM.forward"] == (
        "the linear cross-entropy is not fused: its forward also reads logit_scale, which may change the logits "
        "the fused forward never computes")
    _assert_computes_and_trains_as(model, reference)


def test_a_forward_that_divides_its_logits_keeps_its_loss():
    reference, model, report = _outside_pair("GraniteConfig", logits_scaling=4.0)
    left = {(r.kind, r.original): r.reason for r in report.left}
    assert "its forward also reads logits_scaling" in left["loss", "GraniteForCausalLM.forward"]
    _assert_computes_and_trains_as(model, reference)


def test_a_model_on_another_attention_implementation_keeps_it():
    # Gemma 2 soft-caps its attention scores, which sdpa refuses: it runs on eager attention,
    # which takes masks of another form than the ones TileOPs' attention function reads.
    reference, model, report = _outside_pair("Gemma2Config", "eager", head_dim=16, sliding_window=4)
    left = {(r.kind, r.original): r.reason for r in report.left}
    assert left["attention", "Gemma2Attention: eager"] == "its attention implementation is 'eager'; TileOPs' stands in for 'sdpa'"
    assert model.config._attn_implementation == "eager"
    _assert_computes_and_trains_as(model, reference)


def test_a_config_without_a_window_written_as_zero_builds_no_window():
    # Qwen2-MoE's config holds sliding_window=0 where its layers have none.
    reference, model, report = _outside_pair("Qwen2MoeConfig", moe_intermediate_size=32, shared_expert_intermediate_size=32,
                                             num_experts=4, num_experts_per_tok=2)
    assert reference.config.sliding_window == 0
    assert any(r.original == "Qwen2MoeAttention: sdpa attention" for r in report.replaced)
    _assert_computes_and_trains_as(model, reference)


def test_an_mlp_with_fused_gate_and_up_projections_gets_the_packed_op():
    reference, model, report = _outside_pair("Phi3Config", pad_token_id=0)
    mlps = [(r.original, r.replacement) for r in report.replaced if r.original.endswith("MLP")]
    assert mlps == [("Phi3MLP", "tileops.nn.PackedGatedMLP")] * TINY["num_hidden_layers"]
    assert all(isinstance(layer.mlp, tileops.nn.PackedGatedMLP) for layer in model.model.layers)
    assert model.state_dict().keys() == reference.state_dict().keys()
    _assert_computes_and_trains_as(model, reference)


def test_only_a_function_computing_the_ops_rotation_is_replaced():
    from tileops.integrations.transformers.attention import rotation_style
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as halves

    def one_tensor(x, cos, sin, unsqueeze_dim=1):
        return halves(x, x, cos, sin, unsqueeze_dim)[0]

    def without_sin(q, k, cos, sin, unsqueeze_dim=1):
        return q * cos.unsqueeze(unsqueeze_dim), k * cos.unsqueeze(unsqueeze_dim)

    assert rotation_style(halves) == "neox"
    assert rotation_style(one_tensor) is None
    assert rotation_style(without_sin) is None


def test_the_layers_of_one_forward_rotate_with_one_positions_tensor():
    # Each layer's autograd node keeps the positions it rotated with: the layers of a forward
    # (the same cos and sin tensors) share one contiguous tensor rather than a copy each.
    from tileops.integrations.transformers.attention import _rotation

    given = []

    def op(q, k, cos, sin, positions):
        given.append(positions)
        return q, k

    rotate = _rotation(op, original=None)
    q, k = torch.randn(3, 4, 5, 8), torch.randn(3, 2, 5, 8)
    cos, sin = torch.randn(1, 5, 8), torch.randn(1, 5, 8)
    for _ in range(2):
        rotate(q, k, cos, sin)
    rotate(q[:2], k[:2], cos, sin)  # another batch size
    rotate(q, k, cos.clone(), sin)  # the next forward's tables
    with torch.inference_mode():
        rotate(q, k, cos, sin)
    rotate(q, k, cos, sin)  # not the inference tensor, which a backward could not save
    first, again, smaller, next_forward, inference, after = given
    assert again is first and first.is_contiguous() and first.tolist() == [list(range(5))] * 3
    assert smaller is not first and smaller.shape == (2, 5) and next_forward is not first
    assert inference.is_inference() and not after.is_inference()


def test_a_replacement_holds_the_replaced_modules_own_parameters():
    model = tiny_model("qwen3")
    weights = {name: module.weight for name, module in model.named_modules() if type(module).__name__ == "Qwen3RMSNorm"}
    model.model.norm.weight.requires_grad_(False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    tileops_hf.apply(model)
    for name, weight in weights.items():
        assert model.get_submodule(name).weight is weight, name
    assert not model.model.norm.weight.requires_grad

    model(tokens(), labels=tokens()).loss.backward()  # the optimizer built before apply() trains the new modules
    before = model.model.layers[0].self_attn.q_norm.weight.detach().clone()
    optimizer.step()
    assert not torch.equal(model.model.layers[0].self_attn.q_norm.weight, before)


@pytest.fixture
def sdpa_calls(monkeypatch):
    """The calls the attention function hands to transformers' sdpa function (a mask tensor:
    padding), counted; the others ran on AttentionFwdOp."""
    from tileops.integrations.transformers import attention

    attention.register()
    calls = []
    sdpa = attention._sdpa

    def counted(module, query, key, value, attention_mask, **kwargs):
        calls.append(attention_mask is not None)
        return sdpa(module, query, key, value, attention_mask, **kwargs)

    monkeypatch.setattr(attention, "_sdpa", counted)
    return calls


@pytest.mark.parametrize("architecture", sorted(CONFIGS))
def test_generate_runs_with_the_kv_cache_and_picks_the_same_tokens(architecture, sdpa_calls):
    reference, model, _ = patched_pair(architecture)
    ids = tokens(2, 5)
    options = {"max_new_tokens": 4, "do_sample": False, "use_cache": True, "pad_token_id": 0}
    generated = model.generate(ids, **options)
    assert generated.shape == (2, 9)
    assert torch.equal(generated, reference.generate(ids, **options))
    assert sdpa_calls == []  # the prefill and each decode step (1 query over the cache) ran on the ops
    assert model.model.layers[0].self_attn.tileops_attention.decode.built_kernels()  # the steps' op

    # Left padding in a batch: the mask builder gives a mask; the prefill's calls go to sdpa, and
    # each decode step's (one query: its mask row is what it sees) to the decode op's key mask.
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    generated = model.generate(ids, attention_mask=mask, **options)
    assert torch.equal(generated, reference.generate(ids, attention_mask=mask, **options))
    assert sdpa_calls == [True] * TINY["num_hidden_layers"]
    decode = model.model.layers[0].self_attn.tileops_attention.decode
    assert {kernel.cache_layout for _, kernel in decode.built_kernels()} == {"bhsd"}

    # A static cache (what transformers compiles into CUDA graphs): every decode step carries a
    # mask hiding the cache's unfilled rows, and runs on the decode op.
    sdpa_calls.clear()
    static = {**options, "cache_implementation": "static"}
    for attention_mask in (None, mask):
        generated = model.generate(ids, attention_mask=attention_mask, **static)
        assert torch.equal(generated, reference.generate(ids, attention_mask=attention_mask, **static))
    assert sdpa_calls == [True] * TINY["num_hidden_layers"]  # the padded prefill only


def test_the_decode_steps_over_a_static_cache_read_only_its_filled_rows(monkeypatch):
    # Each step's length is its last shown key + 1, so the kernels skip the cache's unfilled
    # tail instead of reading all of it and masking it; left padding does not change it.
    reference, model, _ = patched_pair("llama")
    ops = model.model.layers[0].self_attn.tileops_attention
    decode, lengths = ops.decode, []

    def recorded(**inputs):
        lengths.append(inputs["cache_seqlens"].tolist())
        return decode(**inputs)

    monkeypatch.setattr(ops, "decode", recorded)
    ids = tokens(2, 5)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    options = {"max_new_tokens": 4, "do_sample": False, "use_cache": True, "pad_token_id": 0,
               "cache_implementation": "static"}
    for attention_mask in (None, mask):
        lengths.clear()
        generated = model.generate(ids, attention_mask=attention_mask, **options)
        assert torch.equal(generated, reference.generate(ids, attention_mask=attention_mask, **options))
        # The prompt's 5 rows, then one more per step; every layer's call alike.
        assert lengths == [[n, n] for n in (6, 7, 8) for _ in range(TINY["num_hidden_layers"])]


def test_attention_without_a_mask_computes_what_sdpa_computes():
    # Without a mask tensor transformers' sdpa function masks causally where there is more than
    # one query: one query (a decode step) sees the whole cache, and more queries than keys
    # come only from a prefill into an empty static cache, aligned to the top left.
    from tileops.integrations.transformers import attention

    _, model, _ = patched_pair("llama")
    module = model.model.layers[0].self_attn
    key, value = torch.randn(2, 2, 7, 16), torch.randn(2, 2, 7, 16)
    assert not module.tileops_attention.decode.built_kernels()
    for q_length in (1, 3, 7):
        query = torch.randn(2, 4, q_length, 16)
        got, weights = attention.attention(module, query, key, value, None, scaling=module.scaling)
        expected = torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=q_length > 1, scale=module.scaling,
                                                                    enable_gqa=True)
        torch.testing.assert_close(got, expected.transpose(1, 2))
        assert weights is None
        # One query over the cache is a decode step: the decode op reads the cache heads first.
        assert module.tileops_attention.decode.built_kernels() or q_length > 1
    query = torch.randn(2, 4, 7, 16)
    window = attention.attention(module, query, key, value, None, scaling=module.scaling, sliding_window=3)[0]
    i, j = torch.arange(7)[:, None], torch.arange(7)[None, :]
    band = (j <= i) & (j > i - 3)  # transformers' window: the 3 keys up to the query's own
    expected = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=band, scale=module.scaling, enable_gqa=True)
    torch.testing.assert_close(window, expected.transpose(1, 2))


def test_compiled_decode_steps_over_a_static_cache_match_the_unpatched_model():
    # What transformers compiles for static-cache generation: one decode step's forward, with
    # the cache's bookkeeping (dict mutations) before TileOPs' ops, in one graph; the cache
    # passed by its former name, past_key_values, as callers still do.
    from transformers import StaticCache

    reference, model, _ = patched_pair("llama")
    ids = tokens(2, 5)
    logits = []
    for m in (reference, model):
        cache = StaticCache(config=m.config, max_cache_len=16)
        step = torch.compile(m, backend="aot_eager", fullgraph=True)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # past_key_values' deprecation
            last = m(ids, past_key_values=cache, use_cache=True).logits[:, -1:]
            steps = []
            for _ in range(2):
                last = step(last.argmax(-1), past_key_values=cache, use_cache=True).logits
                steps.append(last)
        logits.append(steps)
    for got, want in zip(logits[1], logits[0]):
        torch.testing.assert_close(got, want)
    assert model.model.layers[0].self_attn.tileops_attention.decode.built_kernels()


@pytest.mark.parametrize(("arch", "head_dim", "prefill", "decode"), [
    (90, 128, True, True),
    (90, 96, False, True),  # the prefill kernels take 64, 128, 256; the decode ones multiples of 32
    (90, 80, False, False),
    (80, 128, False, True),  # the prefill kernels need Hopper
])
def test_on_a_gpu_calls_no_kernel_of_tileops_serves_go_to_sdpa(monkeypatch, arch, head_dim, prefill, decode):
    # The plain-torch reference would serve them, many times slower than transformers' sdpa.
    from types import SimpleNamespace

    from tileops.core import selection
    from tileops.core.device_facts import DeviceFacts
    from tileops.integrations.transformers.attention import AttentionOps

    monkeypatch.setattr(selection, "facts_for", lambda device: DeviceFacts("cuda", arch, 132, 227 * 1024, "GPU"))

    def tensor(*shape, dtype=torch.bfloat16):  # what the decision reads of a tensor
        return SimpleNamespace(device=torch.device("cuda", 0), dtype=dtype, shape=torch.Size(shape))

    ops = AttentionOps(causal=True, scale=None, target=None)
    ops.build(None)
    q, k = tensor(2, 100, 8, head_dim), tensor(2, 100, 2, head_dim)
    assert ops.kernels_serve(ops.get("bshd", None), {"q": q, "k": k, "v": k}) is prefill
    cache = tensor(2, 2, 300, head_dim)
    step = {"q": tensor(2, 1, 8, head_dim), "k_cache": cache, "v_cache": cache, "cache_seqlens": tensor(2, dtype=torch.int32)}
    assert ops.kernels_serve(ops.decode, step) is decode


def test_patching_decides_for_the_gpus_present_so_compiled_calls_find_the_answer(monkeypatch):
    # A compiled call cannot ask the op (selection reads the device outside the graph); without
    # the answer it would take the op, and on a GPU older than the prefill kernels need, the
    # op's plain-torch reference.
    from types import SimpleNamespace

    from tileops.core import selection
    from tileops.core.device_facts import DeviceFacts

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(selection, "facts_for", lambda device: DeviceFacts("cuda", 80, 108, 163 * 1024, "GPU"))
    _, model, _ = patched_pair("llama", head_dim=64)
    ops = model.model.layers[0].self_attn.tileops_attention
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)

    def tensor(*shape, dtype=torch.bfloat16):
        return SimpleNamespace(device=torch.device("cuda", 0), dtype=dtype, shape=torch.Size(shape))

    q, k = tensor(3, 77, 4, 64), tensor(3, 77, 2, 64)  # another batch and length than decided on
    assert ops.kernels_serve(ops.get("bshd", None), {"q": q, "k": k, "v": k}) is False
    cache = tensor(3, 2, 500, 64)
    step = {"q": tensor(3, 1, 4, 64), "k_cache": cache, "v_cache": cache, "cache_seqlens": tensor(3, dtype=torch.int32),
            "key_mask": tensor(3, 500, dtype=torch.bool)}
    assert ops.kernels_serve(ops.decode, step) is True
    # Heads never decided (another model's): a compiled call takes the op.
    assert ops.kernels_serve(ops.get("bshd", None), {"q": tensor(3, 77, 8, 64), "k": k, "v": k}) is True


def test_attention_takes_the_layout_that_copies_least():
    from tileops.integrations.transformers.attention import _layout

    def projected(heads):  # a view of a projection's (B, S, H, D) output, as transformers passes it
        return torch.empty(2, 9, heads, 16).transpose(1, 2)

    assert _layout(projected(8), projected(2), projected(2)) == "bshd"
    # A DynamicCache's keys and values are concatenated, contiguous (B, H, S, D); copying them
    # costs less than copying q and transposing the output back.
    cached = torch.empty(2, 2, 9, 16)
    assert _layout(projected(8), cached, cached) == "bshd"
    # Everything contiguous (B, H, S, D) and as many kv heads as q heads: the output copy is the cheaper.
    assert _layout(torch.empty(2, 8, 9, 16), torch.empty(2, 8, 9, 16), torch.empty(2, 8, 9, 16)) == "bhsd"


def _record_attention_calls(model) -> list[tuple[str, bool, bool, bool]]:
    """The calls of the first layer's attention ops, as they come: (the op's layout, and whether
    q, k and v are contiguous), appended to the returned list."""
    ops = model.model.layers[0].self_attn.tileops_attention
    calls = []

    class Recording:
        def __init__(self, op):
            self.op, self.params = op, op.params

        def __call__(self, q, k, v):
            calls.append((self.params["qkv_layout"], q.is_contiguous(), k.is_contiguous(), v.is_contiguous()))
            return self.op(q, k, v)

    for key in list(ops.ops):
        ops.ops[key] = Recording(ops.ops[key])
    return calls


def test_a_training_step_with_the_cache_on_calls_the_op_without_copying_q():
    # transformers builds a DynamicCache whenever use_cache is on, in training too.
    _, model, _ = patched_pair("llama")
    calls = _record_attention_calls(model)
    model.train()
    model(tokens(), labels=tokens(), use_cache=True).loss.backward()
    # The cache's (B, H, S, D) copies of k and v are not in the op's layout: the op copies them.
    assert calls and set(calls) == {("bshd", True, False, False)}


@pytest.mark.parametrize("use_cache", [None, True], ids=["not-passed", "passed"])
def test_a_training_step_with_labels_builds_no_kv_cache_unless_asked(use_cache):
    # A cache's copies of the keys and values would live until the loss is taken, at the peak.
    _, model, _ = patched_pair("llama")
    calls = _record_attention_calls(model)
    model.train()
    given = {} if use_cache is None else {"use_cache": use_cache}
    output = model(tokens(), labels=tokens(), **given)
    assert (output.past_key_values is None) == (use_cache is None)
    output.loss.backward()
    # Without the cache's concatenation, k and v reach the op as views of the projections in its
    # layout: nothing is copied.
    assert set(calls) == ({("bshd", True, True, True)} if use_cache is None else {("bshd", True, False, False)})
    model.eval()  # evaluation keeps the model's own default
    with torch.no_grad():
        assert model(tokens(), labels=tokens()).past_key_values is not None


def test_the_decision_is_read_inside_a_compiled_graph():
    # Off the CPU the attention function looks the decision up while Dynamo traces it (meta
    # tensors stand for a GPU's here): the lookup must trace, with dynamic shapes too.
    from tileops.integrations.transformers.attention import AttentionOps

    ops = AttentionOps(causal=True, scale=None, target=None)
    ops.build(None)
    op = ops.get("bshd", None)
    k = torch.empty(2, 5, 2, 16, device="meta")
    for decided in (False, True):
        ops._kernels_serve[(op, k.device, k.dtype, False, (4, 2, 16))] = decided

        def route(q):  # the two branches give results of different shapes
            return q * 2 if ops.kernels_serve(op, {"q": q, "k": k, "v": k}) else q.sum(0)

        for dynamic in (False, True):
            torch._dynamo.reset()
            counter = torch._dynamo.testing.CompileCounter()
            compiled = torch.compile(route, fullgraph=True, dynamic=dynamic, backend=counter)
            q = torch.empty(3, 7, 4, 16, device="meta")
            assert compiled(q).shape == (q.shape if decided else q.shape[1:]) and counter.frame_count == 1


def test_a_call_the_ops_kernels_do_not_serve_computes_on_sdpa(monkeypatch, sdpa_calls):
    from tileops.integrations.transformers import attention
    from tileops.integrations.transformers.attention import AttentionOps

    _, model, _ = patched_pair("llama")
    module = model.model.layers[0].self_attn
    monkeypatch.setattr(AttentionOps, "kernels_serve", lambda self, op, inputs: False)
    key, value = torch.randn(2, 2, 7, 16), torch.randn(2, 2, 7, 16)
    for q_length in (1, 7):  # a decode step, a prefill
        query = torch.randn(2, 4, q_length, 16)
        got, _ = attention.attention(module, query, key, value, None, scaling=module.scaling)
        expected = torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=q_length > 1,
                                                                    scale=module.scaling, enable_gqa=True)
        torch.testing.assert_close(got, expected.transpose(1, 2))
    assert sdpa_calls == [False, False]
    assert not module.tileops_attention.decode.built_kernels()


def test_the_compiled_patched_model_trains_in_one_graph():
    # AOTAutograd's eager backend: dynamo traces the whole model (TileOPs' custom ops and their
    # autograd formulas included) without the minutes inductor's C++ code generation takes on a
    # CPU; tests/test_nn.py compiles the modules with inductor.
    reference, model, report = patched_pair("qwen3")
    model.train()
    reference.train()
    ids = tokens()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    loss = compiled(ids, labels=ids).loss
    loss.backward()
    loss_reference = reference(ids, labels=ids).loss
    loss_reference.backward()
    torch.testing.assert_close(loss, loss_reference)
    for name in ("self_attn.q_norm.weight", "self_attn.q_proj.weight", "mlp.gate_proj.weight"):
        torch.testing.assert_close(model.model.layers[0].get_parameter(name).grad, reference.model.layers[0].get_parameter(name).grad)
    torch.testing.assert_close(model.lm_head.weight.grad, reference.lm_head.weight.grad)


def test_under_torch_compile_the_attention_of_a_call_without_padding_runs_on_the_op_not_sdpa():
    # transformers' own mask builder builds a causal mask whenever it is traced on torch before
    # 2.14 (tools/torch-floor.sh runs this test on the floor, 2.11), which would send every
    # compiled attention call to sdpa; the "tileops" builder builds none for a causal call
    # without padding, as transformers does eagerly.
    reference, model, _ = patched_pair("llama")
    graphs = []

    def recording(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    ids = tokens()
    logits = torch.compile(model, backend=recording, fullgraph=True)(ids).logits
    torch.testing.assert_close(logits, reference(ids).logits)
    targets = [str(node.target) for graph in graphs for node in graph.graph.nodes if node.op == "call_function"]
    assert sum("AttentionFwdOp" in target for target in targets) == TINY["num_hidden_layers"], targets
    assert not [target for target in targets if "scaled_dot_product" in target]
    # With padding (a mask that hides keys) the call still goes to sdpa, compiled or not.
    graphs.clear()
    padding = torch.ones_like(ids)
    padding[0, :3] = 0
    logits = torch.compile(model, backend=recording, fullgraph=True)(ids, attention_mask=padding).logits
    torch.testing.assert_close(logits[1], reference(ids, attention_mask=padding).logits[1])
    targets = [str(node.target) for graph in graphs for node in graph.graph.nodes if node.op == "call_function"]
    assert [target for target in targets if "scaled_dot_product" in target]


def test_the_rotating_forward_reads_globals_no_compiler_takes_for_its_modules():
    # torch.compile up to 2.11 resolves globals that carry a module's __name__ through that
    # module: it guarded the patched rotation on the module's own function and failed on CUDA.
    _, model, _ = patched_pair("qwen3")
    forward = type(model.model.layers[0].self_attn).forward
    module = sys.modules[type(model.model.layers[0].self_attn).tileops_original.__module__]
    assert forward.__globals__["apply_rotary_pos_emb"] is not module.apply_rotary_pos_emb
    assert "__name__" not in forward.__globals__


def test_the_report_lists_what_was_replaced_and_what_was_left():
    _, model, report = patched_pair("qwen3")
    text = str(report)
    assert text.splitlines()[0] == "TileOPs in Qwen3ForCausalLM: 17 parts replaced, 1 part left"
    assert ("  Qwen3RMSNorm -> tileops.integrations.transformers.LlamaRMSNorm (9): model.layers.{0-1}.self_attn.q_norm, "
            "model.layers.{0-1}.self_attn.k_norm, model.layers.{0-1}.input_layernorm, "
            "model.layers.{0-1}.post_attention_layernorm, model.norm") in text
    assert "  Qwen3MLP -> tileops.nn.GatedMLP (2): model.layers.{0-1}.mlp" in text
    assert "  Qwen3Attention: apply_rotary_pos_emb -> RotaryEmbeddingFwdOp (2): model.layers.{0-1}.self_attn" in text
    assert "  Qwen3Attention: sdpa attention -> AttentionFwdOp, DecodeAttentionFwdOp for decode steps (sdpa for other masks and calls no kernel takes) (2): model.layers.{0-1}.self_attn" in text
    assert "  ForCausalLMLoss -> CrossEntropyFwdOp (1): loss_function" in text
    assert "  Qwen3ForCausalLM.forward -> LinearCrossEntropyFwdOp in training with labels (no logits, no KV cache) (1): forward" in text
    assert "  rotary embedding: Qwen3RotaryEmbedding (1): model.rotary_emb: it computes the cos and sin tables, in torch" in text

    again = tileops_hf.apply(model)  # a second call replaces nothing
    assert not again.replaced
    assert {r.reason for r in again.left if r.kind in ("norm", "MLP activation")} == {"already a TileOPs module"}
    assert {r.reason for r in again.left if r.kind == "attention"} == {"already on TileOPs"}

    kept = tiny_model("qwen3")
    partial = tileops_hf.apply(kept, attention=False, fused_loss=False)
    assert kept.config._attn_implementation == "sdpa"
    assert {r.reason for r in partial.left if r.kind == "attention"} == {"apply(attention=False)"}
    kept.train()
    assert kept(tokens(), labels=tokens()).logits is not None


def test_target_reaches_every_replacement():
    model = tiny_model("llama")
    report = tileops_hf.apply(model, target="builtin")
    assert "(target builtin)" in str(report)
    modules = {model.get_submodule(r.path) for r in report.replaced if "RMSNorm" in r.original or "MLP" in r.original}
    assert {getattr(m, "op", getattr(m, "act", None) and m.act.op).requested_target for m in modules} == {"builtin"}
    attention_ops = model.model.layers[0].self_attn.tileops_attention
    assert {op.requested_target for op in attention_ops.ops.values()} == {"builtin"}
    assert {op.requested_target for op in model.tileops_linear_loss} == {"builtin"}
    assert {model.loss_function.mean.requested_target, model.loss_function.sum.requested_target} == {"builtin"}


def test_a_module_with_hooks_is_left_and_said_so():
    model = tiny_model("llama")
    model.model.norm.register_forward_hook(lambda module, args, output: None)
    report = tileops_hf.apply(model)
    (left,) = [r for r in report.left if r.kind == "norm"]
    assert left.path == "model.norm" and left.reason == "it has forward_hooks: replacing it would drop them"
    assert type(model.model.norm).__name__ == "LlamaRMSNorm" and model.model.norm.__module__.startswith("transformers")


def test_loading_and_patching_in_one_step_and_checkpoints_are_unchanged(tmp_path):
    reference = tiny_model("gemma")
    reference.save_pretrained(tmp_path)
    model = tileops_hf.from_pretrained(transformers.AutoModelForCausalLM, str(tmp_path))
    assert isinstance(model.model.norm, tileops_hf.GemmaRMSNorm)
    assert len(model.tileops_report.replaced) == 13  # 5 norms; per layer the MLP, the rotation, attention; the loss twice
    torch.testing.assert_close(model.model.norm.weight, reference.model.norm.weight)

    config_model = tileops_hf.patched(transformers.AutoModelForCausalLM.from_config, target="builtin")(reference.config)
    assert config_model.model.norm.op.requested_target == "builtin"

    model.save_pretrained(tmp_path / "patched")  # the patched model's checkpoint loads unpatched
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "patched")
    ids = tokens()
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits)
        torch.testing.assert_close(loaded(ids).logits, reference(ids).logits)


@pytest.mark.parametrize(
    ("x_dtype", "weight_dtype"),
    [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16), (torch.float16, torch.float32)],
    ids=["bf16", "bf16-fp32-weight", "fp32-bf16-weight", "fp16-fp32-weight"],
)
def test_the_norms_keep_transformers_result_dtype(x_dtype, weight_dtype):
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    x = torch.randn(3, 4, 32, dtype=x_dtype, requires_grad=True)
    for theirs in (LlamaRMSNorm(32, eps=1e-5), GemmaRMSNorm(32, eps=1e-5)):
        with torch.no_grad():
            theirs.weight.add_(torch.randn(32))
        theirs.to(weight_dtype)
        ours = copy.deepcopy(theirs)
        holder = torch.nn.Sequential(ours)
        tileops_hf.apply(holder)
        expected, got = theirs(x), holder[0](x)
        assert got.dtype == expected.dtype
        torch.testing.assert_close(got, expected, rtol=1.6e-2, atol=1e-2)
        (weight_grad,) = torch.autograd.grad(got.float().sum(), holder[0].weight)
        (weight_grad_reference,) = torch.autograd.grad(expected.float().sum(), theirs.weight)
        torch.testing.assert_close(weight_grad, weight_grad_reference, rtol=2e-2, atol=2e-2)


class MyRMSNorm(torch.nn.Module):
    """T5's RMSNorm, as a model outside transformers writes it."""

    def __init__(self, n, eps=1e-6):
        super().__init__()
        self.weight = torch.nn.Parameter(1 + 0.1 * torch.randn(n))
        self.variance_epsilon = eps

    def forward(self, x):
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return self.weight * (x.float() * torch.rsqrt(variance + self.variance_epsilon)).to(x.dtype)


class OffsetRMSNorm(MyRMSNorm):
    """Gemma's formula under another name."""

    def forward(self, x):
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (normed * (1 + self.weight.float())).type_as(x)


class EpsOutsideRMSNorm(MyRMSNorm):
    """Its eps is added outside the square root: close, but not what the op computes."""

    def forward(self, x):
        return self.weight * x / (x.pow(2).mean(-1, keepdim=True).sqrt() + self.variance_epsilon)


class ScaleNorm(torch.nn.Module):
    def __init__(self, n):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.tensor(float(n) ** 0.5))

    def forward(self, x):
        return self.scale * x / x.norm(dim=-1, keepdim=True).clamp(min=1e-5)


class UnknownModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(8, 32)
        self.blocks = torch.nn.ModuleList([torch.nn.LayerNorm(32), MyRMSNorm(32), OffsetRMSNorm(32), torch.nn.RMSNorm(32, eps=1e-6),
                                           EpsOutsideRMSNorm(32, eps=1e-2), ScaleNorm(32)])
        self.shared = self.blocks[0]  # one module under two paths

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = h + block(h)
        return self.shared(h)


def test_an_unknown_architecture_gets_what_is_recognised_replaced_and_the_rest_reported():
    torch.manual_seed(0)
    reference = UnknownModel()
    with torch.no_grad():
        for module in reference.blocks[:1]:
            module.weight.add_(0.1 * torch.randn(32))
    model = copy.deepcopy(reference)
    report = tileops_hf.apply(model)
    replaced = {(r.path, r.original, r.replacement) for r in report.replaced}
    assert replaced == {
        ("blocks.0", "LayerNorm", "tileops.nn.LayerNorm"),
        ("shared", "LayerNorm", "tileops.nn.LayerNorm"),
        ("blocks.1", "MyRMSNorm", "tileops.integrations.transformers.LlamaRMSNorm"),
        ("blocks.2", "OffsetRMSNorm", "tileops.integrations.transformers.GemmaRMSNorm"),
        ("blocks.3", "RMSNorm", "tileops.nn.RMSNorm"),
    }
    assert model.shared is model.blocks[0] and isinstance(model.shared, tileops.nn.LayerNorm)
    left = {r.path: r for r in report.left}
    assert left.keys() == {"blocks.4", "blocks.5"}
    assert left["blocks.4"].reason.startswith("its output on a probe input matches no TileOPs module (LlamaRMSNorm's formula: ")
    assert left["blocks.5"].reason == "no TileOPs module computes it"
    assert "\n  norm: ScaleNorm (1): blocks.5: no TileOPs module computes it" in str(report)
    assert model.state_dict().keys() == reference.state_dict().keys()

    x = torch.randn(5, 8, requires_grad=True)
    x_reference = x.detach().clone().requires_grad_()
    torch.testing.assert_close(model(x), reference(x_reference))
    model(x).square().sum().backward()
    reference(x_reference).square().sum().backward()
    torch.testing.assert_close(x.grad, x_reference.grad)


def test_the_ops_modules_and_command_line_do_not_import_transformers():
    code = ("import sys, tileops.ops, tileops.nn, tileops.integrations, tileops.integrations.transformers, "
            "tileops.cli.main, tileops.cli.demo; "
            "assert 'transformers' not in sys.modules, 'transformers was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


# -- the GPU tier: the same comparisons at bfloat16 on CUDA, where the TileLang kernels serve the ops --


@pytest.mark.gpu
@pytest.mark.parametrize("architecture", sorted(CONFIGS))
def test_on_cuda_the_patched_model_computes_trains_and_generates_as_the_unpatched_one(architecture):
    # head_dim 64 and hidden 256: widths the kernels take, as real models' are.
    reference, model, report = patched_pair(architecture, torch.bfloat16, hidden_size=256, intermediate_size=512)
    reference.cuda()
    model.cuda()
    ids = tokens(2, 64).cuda()
    with torch.no_grad():  # logits up to about 2: an ulp of bfloat16 there is 0.0156
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=1.6e-2, atol=2e-2)
    model.train()
    reference.train()
    loss, loss_reference = model(ids, labels=ids).loss, reference(ids, labels=ids).loss
    torch.testing.assert_close(loss, loss_reference, **TOLERANCE[torch.bfloat16])
    loss.backward()
    loss_reference.backward()
    expected = dict(reference.named_parameters())
    for name, parameter in model.named_parameters():
        assert_gradients_close(parameter.grad, expected[name].grad, name)
    layer = model.model.layers[0]
    ops = [model.get_submodule(r.path).op for r in report.replaced if "RMSNorm" in r.original]
    losses = [op for op in model.tileops_linear_loss if op.built_kernels()]  # the mean's ran; the sum's did not
    assert losses
    ops += [layer.mlp.act.op, *losses, *(op for op in layer.self_attn.tileops_attention.ops.values() if op.built_kernels())]
    for op in ops:  # every op that ran, ran a TileLang kernel, none the CPU's
        kernels = op.built_kernels()
        assert kernels and all(type(kernel).__module__.startswith("tileops.kernels.cuda") for _, kernel in kernels), type(op).__name__
    model.eval()
    reference.eval()
    options = {"max_new_tokens": 4, "do_sample": False, "use_cache": True, "pad_token_id": 0}
    generated = model.generate(ids[:, :8], **options)
    assert generated.shape == (2, 12)
    # Greedy tokens of a bfloat16 model may part where two logits tie within rounding: the first
    # new token, from the same prompt, must agree.
    assert torch.equal(generated[:, 8], reference.generate(ids[:, :8], **options)[:, 8])
    # The decode steps ran on the decode op's TileLang kernel, over the cache heads first.
    assert [key for key, _ in layer.self_attn.tileops_attention.decode.built_kernels()] == ["tilelang"]
    # Over a static cache too, each step's mask its key mask (a kernel built for masked calls).
    static = {**options, "cache_implementation": "static"}
    generated = model.generate(ids[:, :8], **static)
    assert torch.equal(generated[:, 8], reference.generate(ids[:, :8], **static)[:, 8])
    decode_kernels = [kernel for _, kernel in layer.self_attn.tileops_attention.decode.built_kernels()]
    assert sorted(kernel.call.masked for kernel in decode_kernels) == [False, True]


@pytest.mark.gpu
def test_on_cuda_the_compiled_patched_model_trains():
    reference, model, _ = patched_pair("qwen3", torch.bfloat16, hidden_size=256, intermediate_size=512)
    reference.cuda().train()
    model.cuda().train()
    ids = tokens(2, 64).cuda()
    loss = torch.compile(model)(ids, labels=ids).loss
    loss.backward()
    loss_reference = reference(ids, labels=ids).loss
    loss_reference.backward()
    torch.testing.assert_close(loss, loss_reference, **TOLERANCE[torch.bfloat16])
    expected = dict(reference.named_parameters())
    for name, parameter in model.named_parameters():
        assert_gradients_close(parameter.grad, expected[name].grad, name)


def test_the_architecture_check_passes_on_the_architectures_it_names_and_refuses_unknown_types(capsys):
    check = load_tool("check_transformers_models")
    assert check.main(["llama", "cohere"]) == 0
    table = capsys.readouterr().out
    assert "| llama | ok | 13 replaced (" in table and "| cohere | ok | 7 replaced (" in table and "\n2 ok\n" in table
    with pytest.raises(SystemExit):
        check.main(["no_such_type"])
    assert "not causal-LM model types of transformers" in capsys.readouterr().err


def test_the_cpu_training_benchmark_times_every_op_of_a_layer_against_torch():
    bench = load_tool("bench_cpu_training")
    text = bench.main(["--tokens", "16", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--intermediate", "96",
                       "--vocab", "50", "--calls", "1", "--loops", "1"])
    rows = text.splitlines()[2:]
    assert [row.split(" (")[0] for row in rows] == [
        "RMSNorm", "LayerNorm", "SwiGLU", "RoPE q", "attention causal", "cross-entropy"]
    assert all(float(value) > 0 for row in rows for value in row.split()[-3:])


def test_the_end_to_end_benchmark_runs_its_quick_form():
    import argparse

    bench = load_tool("bench_llama")
    text = bench.main(["--quick", "--variants", "eager,tileops", "--device", "cpu", "--kernel-profile", "3"])
    rows = [line for line in text.splitlines() if line.startswith("| eager |") or line.startswith("| tileops |")]
    assert len(rows) == 2 and "13 parts replaced, 1 left (rotary embedding 1)" in rows[1]
    cells = [row.split("|")[2:7] for row in rows]
    assert all(cell.strip() == "not measured" for row in cells for cell in row[1:3])  # torch counts CUDA memory only
    assert all(float(cell) > 0 for row in cells for cell in row[:1] + row[3:])
    # --kernel-profile: each variant's three largest consumers of a training step's and a prefill's time.
    for variant in ("eager", "tileops"):
        for what in ("training step", "prefill"):
            heading = f"{variant}, one {what}: "
            (start,) = [i for i, line in enumerate(text.splitlines()) if line.startswith(heading)]
            assert " ms of CPU time in " in text.splitlines()[start]
            listed = text.splitlines()[start + 1 : start + 4]
            assert len(listed) == 3 and all(" ms " in line and " x " in line for line in listed), listed

    # Each variant is measured in a process of its own; one that fails there raises its last
    # line of error output.
    args = argparse.Namespace(quick=True, batch=2, seq=16, prompt=4, new_tokens=4, repeats=1, dtype="no_such_dtype",
                              device="cpu", peak_breakdown=False, kernel_profile=0)
    with pytest.raises(bench.VariantFailed, match="no attribute 'no_such_dtype'"):
        bench.measure_apart("eager", args)

    # A variant that fails is its row's failure; the others are still measured.
    measure_apart = bench.measure_apart

    def out_of_memory_in_eager(variant, *args):
        if variant == "eager":
            raise bench.VariantFailed("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB")
        return measure_apart(variant, *args)

    bench.measure_apart = out_of_memory_in_eager
    text = bench.main(["--quick", "--variants", "eager,tileops", "--device", "cpu"])
    assert "| eager | | | | | | not run: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB |" in text
    assert any(line.startswith("| tileops | ") and "13 parts replaced" in line for line in text.splitlines())
