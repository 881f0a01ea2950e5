"""The MLP patcher of the transformers integration: a Llama-style gated MLP (``gate_proj``,
``up_proj``, ``down_proj`` and ``act_fn``: ``down(act(gate(x)) * up(x))``) becomes
``tileops.nn.GatedMLP`` holding the same ``Linear`` modules, its activation whichever of SiLU,
exact GELU and tanh GELU ``act_fn`` computes on a probe input. One with the gate and up
projections fused (``gate_up_proj``, ``down_proj`` and ``activation_fn``, as Phi-3's) becomes
``tileops.nn.PackedGatedMLP`` where its output on a probe input is the replacement's."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import tileops.nn
from tileops.integrations.transformers.norms import qualified_name

#: transformers' MLP classes of the listed architectures, read from their modeling code:
#: ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``. Other classes ending in MLP with the same
#: children are compared with the replacement on a probe input first.
KNOWN_MLPS = frozenset({
    "transformers.models.llama.modeling_llama.LlamaMLP",
    "transformers.models.mistral.modeling_mistral.MistralMLP",
    "transformers.models.qwen2.modeling_qwen2.Qwen2MLP",
    "transformers.models.qwen3.modeling_qwen3.Qwen3MLP",
    "transformers.models.gemma.modeling_gemma.GemmaMLP",
})

#: GatedMLP's activation names and the function each computes, in the order they are probed.
_ACTIVATIONS = (
    ("silu", F.silu),
    ("gelu", F.gelu),
    ("gelu_tanh", lambda x: F.gelu(x, approximate="tanh")),
)


def _activation(act_fn: torch.nn.Module) -> str | None:
    """The GatedMLP activation ``act_fn`` computes on a float32 probe, or None."""
    x = torch.linspace(-8.0, 8.0, 257)
    with torch.no_grad():
        got = act_fn(x)
    for name, function in _ACTIVATIONS:
        if torch.allclose(got, function(x), rtol=1e-5, atol=1e-6):
            return name
    return None


def gated_mlp(module: torch.nn.Module, target: str | None) -> torch.nn.Module | str | None:
    """PATCHERS' entry for MLPs: the replacement, a reason to leave the module, or None where it
    is not an MLP."""
    if not type(module).__name__.endswith("MLP"):
        return None
    if hasattr(module, "gate_up_proj"):
        return _packed_gated_mlp(module, target)
    projections = [getattr(module, name, None) for name in ("gate_proj", "up_proj", "down_proj")]
    act_fn = getattr(module, "act_fn", None)
    if not all(type(p) is torch.nn.Linear for p in projections) or not isinstance(act_fn, torch.nn.Module):
        return "not a gated MLP: no gate_proj, up_proj and down_proj Linear modules and act_fn"
    gate, up, down = projections
    if {name for name, _ in module.named_children()} - {"gate_proj", "up_proj", "down_proj", "act_fn"}:
        return f"it holds more than the gated MLP's modules: {sorted(name for name, _ in module.named_children())}"
    activation = _activation(act_fn)
    if activation is None:
        return f"its activation {type(act_fn).__name__} is none of SiLU, GELU and tanh GELU"
    if len({gate.bias is None, up.bias is None, down.bias is None}) != 1:
        return "some of its projections have a bias and others not"
    replacement = tileops.nn.GatedMLP(down.out_features, gate.out_features, activation, bias=gate.bias is not None,
                                      device="meta", target=target)
    replacement.gate_proj, replacement.up_proj, replacement.down_proj = gate, up, down
    replacement.train(module.training)
    if qualified_name(type(module)) not in KNOWN_MLPS:
        difference = _mismatch(module, replacement)
        if difference is not None:
            return f"its output on a probe input differs from GatedMLP's ({difference})"
    return replacement


def _packed_gated_mlp(module: torch.nn.Module, target: str | None) -> torch.nn.Module | str:
    """An MLP with a fused ``gate_up_proj``: its PackedGatedMLP, or why it is left. Always
    probed: no listed architecture fuses the projections, so no such class is known."""
    children = {name: child for name, child in module.named_children()}
    fused, down, act_fn = children.get("gate_up_proj"), children.get("down_proj"), children.get("activation_fn")
    if set(children) != {"gate_up_proj", "down_proj", "activation_fn"} or not all(
            type(p) is torch.nn.Linear for p in (fused, down)):
        return ("not a fused gated MLP: its modules are not gate_up_proj and down_proj Linear modules and "
                f"activation_fn ({sorted(children)})")
    if fused.out_features != 2 * down.in_features:
        return f"gate_up_proj's {fused.out_features} outputs are not twice down_proj's {down.in_features} inputs"
    activation = _activation(act_fn)
    if activation is None:
        return f"its activation {type(act_fn).__name__} is none of SiLU, GELU and tanh GELU"
    if (fused.bias is None) != (down.bias is None):
        return "one of its projections has a bias and the other not"
    replacement = tileops.nn.PackedGatedMLP(down.out_features, down.in_features, activation, bias=fused.bias is not None,
                                            device="meta", target=target)
    replacement.gate_up_proj, replacement.down_proj = fused, down
    replacement.train(module.training)
    difference = _mismatch(module, replacement)
    if difference is not None:
        return f"its output on a probe input differs from PackedGatedMLP's ({difference})"
    return replacement


def _mismatch(module: torch.nn.Module, replacement: torch.nn.Module) -> str | None:
    """How an MLP of unknown code differs from its replacement on a probe input, or None."""
    weight = replacement.down_proj.weight
    if weight.is_meta:
        return "its weights are on the meta device: there is nothing to probe it with"
    x = torch.randn(3, replacement.hidden_size, generator=torch.Generator().manual_seed(0)).to(weight.device, weight.dtype)
    with torch.no_grad():
        expected = module(x)
        got = replacement(x)
    if not isinstance(expected, torch.Tensor) or expected.shape != got.shape:
        return "it returns something else than a tensor of the input's shape"
    tolerance = {"rtol": 1e-4, "atol": 1e-5} if x.dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    if not torch.allclose(got.float(), expected.float(), **tolerance):
        return f"largest difference {(got.float() - expected.float()).abs().max().item():.3g}"
    return None
