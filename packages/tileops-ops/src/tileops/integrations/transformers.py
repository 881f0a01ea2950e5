"""Hugging Face transformers models on TileOPs, in one call.

``apply(model, target=None)`` replaces, in place, each module of ``model`` that TileOPs has an
op for, and returns a ``Report`` (print it) of what it replaced and what it left, and why. Today
that is the norms:

* transformers' RMSNorm classes of Llama, Mistral, Qwen2 and Qwen3 (the decoder norms and
  Qwen3's per-head ``q_norm`` and ``k_norm``) become ``LlamaRMSNorm``, and Gemma's becomes
  ``GemmaRMSNorm`` (``x * (1 + weight)``), recognised by their class;
* any other module whose class name ends in ``RMSNorm``, with a 1-D ``weight`` and a
  ``variance_epsilon`` or ``eps``, becomes whichever of the two computes what it computes on a
  probe input (float32 and bfloat16, random weights, a row whose mean square is about eps); one
  that matches neither is left, and reported;
* ``torch.nn.LayerNorm`` and ``torch.nn.RMSNorm`` instances become ``tileops.nn.LayerNorm`` and
  ``tileops.nn.RMSNorm``.

A replacement holds the replaced module's own ``Parameter`` objects, so the ``state_dict`` keys,
an optimizer built before the call, tied weights and checkpoints are unchanged. MLP activations,
rotary embeddings, attention and the loss are reported as left, "not patched yet: no TileOPs op":
their families add a patcher to ``PATCHERS`` and take their row out of ``NOT_PATCHED_YET``.

Call it before ``torch.compile``; an optimizer built before or after it sees the same
parameters. ``from_pretrained(cls, ...)`` and
``patched(loader)`` load and apply in one step. Nothing here imports transformers: classes are
recognised by their module and name.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch.func import functional_call

import tileops.nn

__all__ = [
    "NOT_PATCHED_YET",
    "PATCHERS",
    "GemmaRMSNorm",
    "Left",
    "LlamaRMSNorm",
    "Replaced",
    "Report",
    "apply",
    "from_pretrained",
    "patched",
]

_log = logging.getLogger(__name__)

NOT_YET = "not patched yet: no TileOPs op"


# -- the modules ----------------------------------------------------------------------------------


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


# -- what replaces what ---------------------------------------------------------------------------

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


def _name(cls: type) -> str:
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


def _known_rms_norm(module: torch.nn.Module, target: str | None) -> torch.nn.Module | str | None:
    cls = KNOWN_RMS_NORMS.get(_name(type(module)))
    if cls is None:
        return None
    return _rebuild(cls, module, tuple(module.weight.shape), _eps(module), target)


def _torch_norm(module: torch.nn.Module, target: str | None) -> torch.nn.Module | str | None:
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


def _probed_rms_norm(module: torch.nn.Module, target: str | None) -> torch.nn.Module | str | None:
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


#: What apply() tries on each module, in order: (kind, patcher). A patcher takes (module,
#: target) and returns the replacement, a reason to leave the module (a str), or None where the
#: module is not its kind. A family whose op lands adds its patcher here (the MLP activation,
#: the rotary embedding, attention) and takes its row out of NOT_PATCHED_YET.
PATCHERS: list[tuple[str, Callable[[torch.nn.Module, str | None], torch.nn.Module | str | None]]] = [
    ("norm", _known_rms_norm),
    ("norm", _torch_norm),
    ("norm", _probed_rms_norm),
]


def _mlp(module: torch.nn.Module) -> str | None:
    if not type(module).__name__.endswith("MLP"):
        return None
    activation = getattr(module, "act_fn", None)
    return f"activation {type(activation).__name__}" if activation is not None else ""


def _rotary(module: torch.nn.Module) -> str | None:
    return "" if type(module).__name__.endswith("RotaryEmbedding") else None


def _attention(module: torch.nn.Module) -> str | None:
    if not type(module).__name__.endswith("Attention"):
        return None
    implementation = getattr(getattr(module, "config", None), "_attn_implementation", None)
    return f"implementation {implementation}" if implementation else ""


#: The parts of a transformers model TileOPs has no op for yet: kind -> a test that returns
#: None for a module not of the kind, else a detail for the report ("" for none). apply()
#: reports each match as left, "not patched yet: no TileOPs op" (the loss: the model's
#: ``loss_function``). When a family's op lands, its row leaves this table and its patcher joins
#: PATCHERS.
NOT_PATCHED_YET: dict[str, Callable[[torch.nn.Module], str | None]] = {
    "MLP activation": _mlp,
    "rotary embedding": _rotary,
    "attention": _attention,
}


# -- the report -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Replaced:
    """A module apply() replaced: its path in the model, its class and the TileOPs module's class."""

    path: str
    original: str
    replacement: str


@dataclasses.dataclass(frozen=True)
class Left:
    """A part apply() left as it was: its path, its class (or function), its kind and why."""

    path: str
    original: str
    kind: str
    reason: str


@dataclasses.dataclass
class Report:
    """What ``apply()`` did to a model; ``print(report)`` lists it, by type."""

    model: str
    target: str | None = None
    replaced: list[Replaced] = dataclasses.field(default_factory=list)
    left: list[Left] = dataclasses.field(default_factory=list)

    def __str__(self) -> str:
        target = "" if self.target is None else f" (target {self.target})"
        lines = [f"TileOPs in {self.model}{target}: {_count(self.replaced, 'module')} replaced, {_count(self.left, 'part')} left"]
        if self.replaced:
            lines.append("replaced:")
            groups = _grouped(self.replaced, lambda r: f"{r.original} -> {r.replacement}")
            lines += [f"  {key} ({len(paths)}): {', '.join(_compressed(paths))}" for key, paths in groups.items()]
        if self.left:
            lines.append("left:")
            groups = _grouped(self.left, lambda r: (f"{r.kind}: {r.original}", r.reason))
            lines += [f"  {key} ({len(paths)}): {', '.join(_compressed(paths))}: {reason}" for (key, reason), paths in groups.items()]
        return "\n".join(lines)


def _count(entries: list, noun: str) -> str:
    return f"{len(entries)} {noun}{'' if len(entries) == 1 else 's'}"


def _grouped(entries, key) -> dict[Any, list[str]]:
    groups: dict[Any, list[str]] = {}
    for entry in entries:
        groups.setdefault(key(entry), []).append(entry.path)
    return groups


def _compressed(paths: list[str]) -> list[str]:
    """Paths that differ in one index only, as one: ``model.layers.{0-31}.input_layernorm``."""
    groups: dict[tuple[str, ...], list[list[str]]] = {}
    for path in paths:
        parts = path.split(".")
        groups.setdefault(tuple("#" if part.isdigit() else part for part in parts), []).append(parts)
    lines = []
    for key, members in groups.items():
        varying = [i for i, part in enumerate(key) if part == "#" and len({m[i] for m in members}) > 1]
        if len(varying) != 1:
            lines += [".".join(m) for m in members]
            continue
        (i,) = varying
        parts = list(members[0])
        parts[i] = "{" + _ranges(sorted({int(m[i]) for m in members})) + "}"
        lines.append(".".join(parts))
    return lines


def _ranges(numbers: list[int]) -> str:
    runs: list[list[int]] = []
    for number in numbers:
        if runs and number == runs[-1][1] + 1:
            runs[-1][1] = number
        else:
            runs.append([number, number])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


# -- applying it ----------------------------------------------------------------------------------


def _hooks(module: torch.nn.Module) -> str | None:
    """Why replacing ``module`` would lose something attached to the instance, or None."""
    if "forward" in vars(module):
        return "its instance has a forward of its own (an accelerate device_map hook or a kernels layer?): replacing it would drop it"
    attached = [name.strip("_") for name in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
                                             "_state_dict_hooks", "_load_state_dict_pre_hooks") if getattr(module, name, None)]
    if attached:
        return f"it has {', '.join(attached)}: replacing it would drop them"
    return None


def _outcome(module: torch.nn.Module, target: str | None) -> tuple[str, torch.nn.Module | str] | None:
    """(kind, replacement or reason to leave it) for one module, or None where it is not one
    apply() patches or reports."""
    if isinstance(module, (tileops.nn.RMSNorm, tileops.nn.LayerNorm, tileops.nn.FusedAddRMSNorm, tileops.nn.FusedAddLayerNorm)):
        return "norm", "already a TileOPs module"
    for kind, patcher in PATCHERS:
        result = patcher(module, target)
        if result is None:
            continue
        if isinstance(result, torch.nn.Module):
            reason = _hooks(module)
            if reason is None and set(result.state_dict()) != set(module.state_dict()):
                reason = f"the replacement's state_dict keys {sorted(result.state_dict())} differ from {sorted(module.state_dict())}"
            if reason is not None:
                return kind, reason
        return kind, result
    for kind, test in NOT_PATCHED_YET.items():
        detail = test(module)
        if detail is not None:
            return kind, NOT_YET + (f" ({detail})" if detail else "")
    if "Norm" in type(module).__name__:
        return "norm", "no TileOPs module computes it"
    return None


def apply(model: torch.nn.Module, *, target: str | None = None) -> Report:
    """Replace, in place, every module of ``model`` that TileOPs has a module for (the norms,
    today), each bound to ``target`` (None: the default target, as for any op), and return the
    ``Report`` of what was replaced and what was left. Nothing is changed unless every
    replacement could be built. Call it before ``torch.compile``."""
    report = Report(type(model).__name__, target)
    swaps: list[tuple[torch.nn.Module, str, torch.nn.Module]] = []
    seen: dict[int, tuple[str, torch.nn.Module | str] | None] = {}

    def visit(parent: torch.nn.Module, prefix: str) -> None:
        for name, child in parent.named_children():
            path = prefix + name
            first = id(child) not in seen
            if first:
                seen[id(child)] = _outcome(child, target)
            outcome = seen[id(child)]
            if outcome is None:
                if first:
                    visit(child, path + ".")
                continue
            kind, result = outcome
            if isinstance(result, torch.nn.Module):
                swaps.append((parent, name, result))
                report.replaced.append(Replaced(path, type(child).__name__, _name(type(result))))
                continue
            report.left.append(Left(path, type(child).__name__, kind, result))
            if first:  # an attention module holds norms (Qwen3's q_norm and k_norm)
                visit(child, path + ".")

    visit(model, "")
    if hasattr(type(model), "loss_function") and "For" in type(model).__name__:
        loss = getattr(model, "loss_function", None)
        report.left.append(Left("loss_function", getattr(loss, "__name__", type(loss).__name__), "loss", NOT_YET))
    for parent, name, replacement in swaps:
        setattr(parent, name, replacement)
    _log.info("%s", report)
    return report


def patched(load: Callable[..., Any], *, target: str | None = None) -> Callable[..., Any]:
    """``load`` followed by ``apply()``: ``patched(AutoModelForCausalLM.from_pretrained)(name)``
    loads and patches. ``load`` is any callable that returns a model (``from_pretrained``,
    ``from_config``), or a tuple whose first item is one; the model's ``tileops_report``
    attribute holds the report."""

    @functools.wraps(load)
    def load_and_apply(*args: Any, **kwargs: Any) -> Any:
        loaded = load(*args, **kwargs)
        model = loaded[0] if isinstance(loaded, tuple) else loaded
        model.tileops_report = apply(model, target=target)
        return loaded

    return load_and_apply


def from_pretrained(cls: Any, *args: Any, target: str | None = None, **kwargs: Any) -> Any:
    """``cls.from_pretrained(*args, **kwargs)``, patched: ``from_pretrained(AutoModelForCausalLM,
    name, dtype=torch.bfloat16)``. The report is the model's ``tileops_report``."""
    return patched(cls.from_pretrained, target=target)(*args, **kwargs)
