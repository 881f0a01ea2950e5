"""The norm patchers of the transformers integration: transformers' RMSNorm classes become
``LlamaRMSNorm`` or ``GemmaRMSNorm`` (recognised by class, or probed where the class is not
known), torch's ``LayerNorm`` and ``RMSNorm`` become ``tileops.nn``'s."""

from __future__ import annotations

import torch
from torch.func import functional_call

import tileops.nn


class LlamaRMSNorm(tileops.nn.RMSNorm):
    """transformers' Llama-style RMSNorm (Llama, Mistral, Qwen2, Qwen3 and most others) on
    ``RMSNormFwdOp``: ``weight * rms_norm(x)``, the norm accumulated in float32 and rounded to
    x's dtype. Where the weight's dtype is wider than x's (float32 weights, bfloat16
    activations) the product is taken in the weight's dtype and the result has it, as
    transformers computes it; otherwise the op applies the weight in the same pass. The
    ``state_dict`` is transformers' (``weight``)."""

    @property
    def variance_epsilon(self) -> float:
        """transformers' name for ``eps``."""
        return self.eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if weight is None or weight.dtype == x.dtype:
            return self.op(x, weight)
        if torch.promote_types(weight.dtype, x.dtype) == x.dtype:
            return self.op(x, weight.to(x.dtype))
        return weight * self.op(x)


class GemmaRMSNorm(tileops.nn.RMSNorm):
    """Gemma's RMSNorm on ``RMSNormFwdOp``: ``rms_norm(x) * (1 + weight)`` in x's dtype. The
    module keeps the checkpoint's ``weight`` (the offset from one, zeros at initialisation) and
    passes ``1 + weight``, computed in float32 and rounded to x's dtype, to the op."""

    def reset_parameters(self) -> None:
        """Zeros for the weight (a unit scale), as Gemma starts."""
        if self.weight is not None:
            torch.nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.op(x, (1.0 + self.weight.float()).to(x.dtype))



#: transformers' RMSNorm classes, by module and class name, and the TileOPs module that computes
#: what each computes (read from transformers' modeling code). Other RMSNorm classes are probed.
KNOWN_RMS_NORMS: dict[str, type[tileops.nn.RMSNorm]] = {
    "transformers.models.llama.modeling_llama.LlamaRMSNorm": LlamaRMSNorm,
    "transformers.models.mistral.modeling_mistral.MistralRMSNorm": LlamaRMSNorm,
    "transformers.models.qwen2.modeling_qwen2.Qwen2RMSNorm": LlamaRMSNorm,
    "transformers.models.qwen3.modeling_qwen3.Qwen3RMSNorm": LlamaRMSNorm,
    "transformers.models.gemma.modeling_gemma.GemmaRMSNorm": GemmaRMSNorm,
}

#: The formulas an unknown RMSNorm class is probed against, in order.
_PROBED = (LlamaRMSNorm, GemmaRMSNorm)


def qualified_name(cls: type) -> str:
    """A class's module and name, as the tables here key transformers' classes."""
    return f"{cls.__module__}.{cls.__qualname__}"


def _eps(module: torch.nn.Module) -> float | None:
    for attribute in ("variance_epsilon", "eps"):
        value = getattr(module, attribute, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return None


def _rebuild(cls: type[torch.nn.Module], module: torch.nn.Module, normalized_shape, eps, target, **options) -> torch.nn.Module:
    """A ``cls`` holding ``module``'s own parameter objects, built without allocating its own."""
    new = cls(normalized_shape, eps, **options, device="meta", target=target)
    for name, parameter in module.named_parameters(recurse=False):
        setattr(new, name, parameter)
    new.train(module.training)
    return new


def known_rms_norm(module: torch.nn.Module, target: str | None) -> torch.nn.Module | str | None:
    cls = KNOWN_RMS_NORMS.get(qualified_name(type(module)))
    if cls is None:
        return None
    return _rebuild(cls, module, tuple(module.weight.shape), _eps(module), target)


def torch_norm(module: torch.nn.Module, target: str | None) -> torch.nn.Module | str | None:
    if type(module) is torch.nn.LayerNorm:
        return _rebuild(tileops.nn.LayerNorm, module, module.normalized_shape, module.eps, target,
                        elementwise_affine=module.elementwise_affine, bias=module.bias is not None)
    if type(module) is torch.nn.RMSNorm:
        return _rebuild(tileops.nn.RMSNorm, module, module.normalized_shape, module.eps, target,
                        elementwise_affine=module.elementwise_affine)
    return None


#: (x dtype, weight dtype) of the probes, and the tolerance each result is compared with.
_PROBES = (
    (torch.float32, torch.float32, {"rtol": 1e-5, "atol": 1e-5}),
    (torch.bfloat16, torch.bfloat16, {"rtol": 1.6e-2, "atol": 1e-5}),
    (torch.bfloat16, torch.float32, {"rtol": 1.6e-2, "atol": 1e-5}),
)


def _mismatch(module: torch.nn.Module, candidate: torch.nn.Module, eps: float) -> str | None:
    """How ``candidate`` differs from ``module`` on the probe inputs, or None where it does not.
    Both run with the same random weight (passed by ``functional_call``: neither module's own
    changes); a local generator leaves the caller's random state alone."""
    (n,) = module.weight.shape
    device = module.weight.device
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(4, n, generator=generator)
    x[1] *= max(eps, 1e-12) ** 0.5  # a row whose mean square is about eps: eps counts
    weight = torch.randn(n, generator=generator)
    for x_dtype, weight_dtype, tolerance in _PROBES:
        xs, parameters = x.to(device, x_dtype), {"weight": weight.to(device, weight_dtype)}
        with torch.no_grad():
            expected = functional_call(module, parameters, (xs,))
            got = functional_call(candidate, parameters, (xs,))
        where = f"{x_dtype} input, {weight_dtype} weight"
        if not isinstance(expected, torch.Tensor) or expected.shape != got.shape or expected.dtype != got.dtype:
            described = f"{expected.dtype} {tuple(expected.shape)}" if isinstance(expected, torch.Tensor) else type(expected).__name__
            return f"{where}: it returns {described}, the formula {got.dtype} {tuple(got.shape)}"
        if not torch.allclose(got.float(), expected.float(), equal_nan=False, **tolerance):
            return f"{where}: largest difference {(got.float() - expected.float()).abs().max().item():.3g}"
    return None


def probed_rms_norm(module: torch.nn.Module, target: str | None) -> torch.nn.Module | str | None:
    if not type(module).__name__.endswith("RMSNorm"):
        return None
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.nn.Parameter) or weight.dim() != 1:
        return "an RMSNorm by its name, without a 1-D weight parameter"
    eps = _eps(module)
    if eps is None:
        return "an RMSNorm by its name, without a variance_epsilon or eps number"
    if set(module.state_dict()) != {"weight"}:
        return f"an RMSNorm by its name, whose state holds more than its weight: {sorted(module.state_dict())}"
    if weight.is_meta:
        return "its weight is on the meta device: there is nothing to probe it with"
    differences = []
    for cls in _PROBED:
        candidate = _rebuild(cls, module, tuple(weight.shape), eps, target)
        try:
            difference = _mismatch(module, candidate, eps)
        except Exception as error:  # noqa: BLE001 - any failure of the probe is a reason to leave it, reported
            difference = f"the probe raised {type(error).__name__}: {error}"
        if difference is None:
            return candidate
        differences.append(f"{cls.__name__}'s formula: {difference}")
    return "its output on a probe input matches no TileOPs module (" + "; ".join(differences) + ")"

