"""Hugging Face transformers models on TileOPs, in one call.

``apply(model, target=None)`` patches ``model`` in place wherever TileOPs has an op for a part
of it, and returns a ``Report`` (print it) of what it replaced and what it left, and why:

* the norms (``norms``): transformers' RMSNorm classes of Llama, Mistral, Qwen2, Qwen3 (its
  per-head ``q_norm`` and ``k_norm`` included) and Gemma (``x * (1 + weight)``), other
  ``*RMSNorm`` classes whose output on a probe input matches one of the two formulas, and torch's
  ``LayerNorm`` and ``RMSNorm``;
* the MLP (``mlp``): a gated MLP (``gate_proj``, ``up_proj``, ``down_proj``, ``act_fn`` SiLU or
  GELU) becomes ``tileops.nn.GatedMLP`` on the SwiGLU / GeGLU op, one with the two projections
  fused (``gate_up_proj``) ``tileops.nn.PackedGatedMLP`` on the packed ops;
* the rotary embedding and attention (``attention``): each attention module's rotation of q and
  k runs on ``RotaryEmbeddingFwdOp``, and the model's attention implementation becomes
  ``"tileops"``, registered in transformers' ``AttentionInterface``, on ``AttentionFwdOp``
  (transformers' sdpa function serves the calls the op cannot express: a padding mask, dropout);
* the loss (``loss``): a causal LM's ``loss_function`` runs on ``CrossEntropyFwdOp``, and in
  training with labels its forward skips the logits and takes the loss from the last hidden
  states on ``LinearCrossEntropyFwdOp`` (``output.logits`` is then None, and so is the KV cache
  unless the call passes ``use_cache=True``; ``fused_loss=False`` keeps the logits).

An architecture it does not know gets what it recognises by module type replaced; the rest is
reported. A replacement module holds the replaced module's own ``Parameter`` objects, and the
attention and loss patches change the instances' classes, not their state, so the
``state_dict``, an optimizer built before the call, tied weights and checkpoints are unchanged.
Nothing is changed unless every replacement could be built. Call it before ``torch.compile``.
``from_pretrained(cls, ...)`` and ``patched(loader)`` load and apply in one step.

Importing this package imports no transformers: classes are recognised by their module and
name, and transformers' registries are reached only when ``apply()`` patches attention.
"""

from __future__ import annotations

import functools
import inspect
import logging
import re
from collections.abc import Callable
from typing import Any

import torch

import tileops.nn
from tileops.integrations.transformers import attention as _attention
from tileops.integrations.transformers import loss as _loss
from tileops.integrations.transformers.mlp import gated_mlp
from tileops.integrations.transformers.norms import (
    KNOWN_RMS_NORMS,
    GemmaRMSNorm,
    LlamaRMSNorm,
    known_rms_norm,
    probed_rms_norm,
    qualified_name,
    torch_norm,
)
from tileops.integrations.transformers.report import Left, Replaced, Report

__all__ = [
    "KNOWN_RMS_NORMS",
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

# The norms are named where users import them (the report says tileops.integrations.transformers.X).
LlamaRMSNorm.__module__ = GemmaRMSNorm.__module__ = __name__

_log = logging.getLogger(__name__)

#: What apply() tries on each module, in order: (kind, patcher). A patcher takes (module,
#: target) and returns the replacement, a reason to leave the module (a str), or None where the
#: module is not its kind.
PATCHERS: list[tuple[str, Callable[[torch.nn.Module, str | None], torch.nn.Module | str | None]]] = [
    ("norm", known_rms_norm),
    ("norm", torch_norm),
    ("norm", probed_rms_norm),
    ("MLP activation", gated_mlp),
]

ROTARY_TABLES = "it computes the cos and sin tables, in torch; the rotation they feed is patched in each attention module"
_TILEOPS_MODULES = (tileops.nn.RMSNorm, tileops.nn.LayerNorm, tileops.nn.FusedAddRMSNorm, tileops.nn.FusedAddLayerNorm,
                    tileops.nn.GatedMLP, tileops.nn.PackedGatedMLP)


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
    apply() replaces or reports."""
    if isinstance(module, _TILEOPS_MODULES):
        mlp = isinstance(module, (tileops.nn.GatedMLP, tileops.nn.PackedGatedMLP))
        return ("MLP activation" if mlp else "norm"), "already a TileOPs module"
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
    if type(module).__name__.endswith("RotaryEmbedding"):
        return "rotary embedding", ROTARY_TABLES
    if "Norm" in type(module).__name__:
        return "norm", "no TileOPs module computes it"
    return None


class _Plan:
    """What apply() found: the report, and the changes it makes once every one could be built."""

    def __init__(self, model: torch.nn.Module, target: str | None) -> None:
        self.report = Report(type(model).__name__, target)
        self.target = target
        self.changes: list[Callable[[], None]] = []
        self.attention_ops: dict = {}
        self.attention_patched = False

    def replace(self, path: str, original: str, replacement: str, change: Callable[[], None]) -> None:
        self.report.replaced.append(Replaced(path, original, replacement))
        self.changes.append(change)

    def leave(self, path: str, original: str, kind: str, reason: str) -> None:
        self.report.left.append(Left(path, original, kind, reason))


def _calls_registry(cls: type) -> bool:
    forward = inspect.unwrap(cls.forward)
    return hasattr(forward, "__code__") and "ALL_ATTENTION_FUNCTIONS" in forward.__code__.co_names


def _plan_attention(plan: _Plan, module: torch.nn.Module, path: str, attention: bool) -> None:
    """The rotation and the attention function of one attention module."""
    cls = type(module)
    name = getattr(cls, "tileops_original", cls).__name__
    rotating = _attention.rotating_class(module, plan.target)
    if isinstance(rotating, type):
        style = "" if rotating.tileops_rotation == "neox" else f" (style={rotating.tileops_rotation})"
        plan.replace(path, f"{name}: apply_rotary_pos_emb", f"RotaryEmbeddingFwdOp{style}",
                     functools.partial(setattr, module, "__class__", rotating))
    else:
        plan.leave(path, f"{name}: apply_rotary_pos_emb", "rotary embedding", rotating)
    config = getattr(module, "config", None)
    implementation = getattr(config, "_attn_implementation", None)
    if not attention:
        plan.leave(path, f"{name}: {implementation}", "attention", "apply(attention=False)")
    elif implementation == _attention.IMPLEMENTATION and getattr(module, "tileops_attention", None) is not None:
        plan.leave(path, f"{name}: {implementation}", "attention", "already on TileOPs")
    elif not _calls_registry(cls):
        plan.leave(path, f"{name}: {implementation}", "attention", "its forward does not call transformers' attention registry")
    elif implementation not in (_attention.STANDS_IN_FOR, _attention.IMPLEMENTATION):
        # The function takes sdpa's masks and hands what its ops do not take to sdpa: a model set
        # to another implementation (Gemma 2's eager, for the soft-capping sdpa refuses) keeps it.
        # One loaded with attn_implementation="tileops" gets its modules' ops here.
        plan.leave(path, f"{name}: {implementation}", "attention",
                   f"its attention implementation is {implementation!r}; TileOPs' stands in for {_attention.STANDS_IN_FOR!r}")
    else:
        ops = _attention.attention_ops(module, plan.target, plan.attention_ops)
        plan.attention_patched = True
        replacement = "AttentionFwdOp, DecodeAttentionFwdOp for decode steps (sdpa for other masks and calls no kernel takes)"
        plan.replace(path, f"{name}: {implementation} attention", replacement,
                     functools.partial(setattr, module, "tileops_attention", ops))


def _plan_loss(plan: _Plan, model: torch.nn.Module, fused_loss: bool) -> None:
    """The loss of a causal LM: its loss_function, and its training forward."""
    cls = type(model)
    name = getattr(cls, "tileops_original", cls).__name__
    if "loss_function" not in dir(cls) or "ForCausalLM" not in name:
        if "loss_function" in dir(cls) and "For" in name:
            plan.leave("loss_function", name, "loss", "not a causal LM: its loss is not the next token's cross-entropy")
        return
    current = model.loss_function
    if isinstance(current, _loss.CausalLMLoss):
        plan.leave("loss_function", "CausalLMLoss", "loss", "already on TileOPs")
    elif getattr(current, "__name__", "") != "ForCausalLMLoss":
        plan.leave("loss_function", getattr(current, "__name__", type(current).__name__), "loss", "not transformers' ForCausalLMLoss")
    else:
        function = _loss.CausalLMLoss(current, plan.target)
        plan.replace("loss_function", "ForCausalLMLoss", "CrossEntropyFwdOp", functools.partial(setattr, model, "loss_function", function))
    reason = _loss.fused_forward_reason(cls) if fused_loss else "apply(fused_loss=False)"
    if getattr(cls, "tileops_fused_loss", False):
        reason = "already on TileOPs"
    head = getattr(model, "lm_head", None)
    if reason is None and (type(head) is not torch.nn.Linear or _hooks(head) is not None):
        reason = "its lm_head is not a plain torch.nn.Linear"
    if reason is not None:
        plan.leave("forward", f"{name}.forward", "loss", f"the linear cross-entropy is not fused: {reason}")
        return
    fused = _loss.fused_forward_class(cls)
    ops = _loss.linear_loss_ops(plan.target, getattr(getattr(model, "config", None), "final_logit_softcapping", None))

    def change() -> None:
        model.tileops_linear_loss = ops
        model.__class__ = fused

    plan.replace("forward", f"{name}.forward", "LinearCrossEntropyFwdOp in training with labels (no logits, no KV cache)", change)


#: The oldest transformers release apply() patches: its attention function and mask builder
#: registries (AttentionInterface, masking_utils) came in the 4.5x releases; 4.57 and 5.x are tested.
OLDEST_TRANSFORMERS = (4, 57)


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def _check_transformers_version() -> None:
    found = _transformers_version()
    release = tuple(int(part) for part in re.findall(r"\d+", found)[:2])
    if release < OLDEST_TRANSFORMERS:
        oldest = ".".join(map(str, OLDEST_TRANSFORMERS))
        raise ImportError(f"tileops.integrations.transformers.apply needs transformers {oldest} or later, found {found}: "
                          f"its attention and mask registries are what the patch joins (pip install -U 'transformers>={oldest}')")


def apply(model: torch.nn.Module, *, target: str | None = None, attention: bool = True, fused_loss: bool = True) -> Report:
    """Patch ``model`` in place (see the module's docstring), each op bound to ``target`` (None:
    the default target, as for any op), and return the ``Report`` of what was replaced and what
    was left. ``attention=False`` leaves attention as it is; ``fused_loss=False`` keeps the
    logits in training (the loss still runs on the cross-entropy op). Call it before
    ``torch.compile``."""
    _check_transformers_version()
    plan = _Plan(model, target)
    seen: dict[int, tuple[str, torch.nn.Module | str] | None] = {}

    def visit(parent: torch.nn.Module, prefix: str) -> None:
        for name, child in parent.named_children():
            path = prefix + name
            first = id(child) not in seen
            if first:
                seen[id(child)] = _outcome(child, target)
                if getattr(type(child), "tileops_original", type(child)).__name__.endswith("Attention"):
                    _plan_attention(plan, child, path, attention)
            outcome = seen[id(child)]
            if outcome is None:
                if first:
                    visit(child, path + ".")
                continue
            kind, result = outcome
            if isinstance(result, torch.nn.Module):
                plan.replace(path, type(child).__name__, qualified_name(type(result)), functools.partial(setattr, parent, name, result))
                continue
            plan.leave(path, type(child).__name__, kind, result)

    visit(model, "")
    _plan_loss(plan, model, fused_loss)
    if plan.attention_patched:
        _attention.register()
    for change in plan.changes:
        change()
    if plan.attention_patched:
        _set_implementation(model)
    _log.info("%s", plan.report)
    return plan.report


def _set_implementation(model: torch.nn.Module) -> None:
    """The model's attention implementation becomes "tileops" (its sub-configs' too, where the
    model has transformers' setter)."""
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(_attention.IMPLEMENTATION)
    else:
        model.config._attn_implementation = _attention.IMPLEMENTATION


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
