"""The loss of transformers causal LMs, on TileOPs.

Two parts, both set on the model instance by ``apply()``:

* ``CausalLMLoss`` replaces the model's ``loss_function`` (transformers' ``ForCausalLMLoss``):
  the labels shifted by one token, the cross-entropy of the logits on ``CrossEntropyFwdOp``,
  averaged over the tokens not ignored, or summed and divided by ``num_items_in_batch`` where the
  caller passes it (as transformers' Trainer does for gradient accumulation).
* ``fused_forward_class(cls)`` is the model's class with a forward that, in training with
  labels, never computes the logits: the last hidden states, the lm-head weight and the shifted
  labels go to ``LinearCrossEntropyFwdOp``, which projects and takes the loss a chunk of rows at a
  time. The output's ``logits`` is then None (as Liger-Kernel's patched forward), and so is its
  KV cache unless the call passes ``use_cache=True``: a training step builds none. In eval mode,
  without labels, or with ``logits_to_keep``, the class's own forward runs (with the
  ``loss_function`` above).

The loss has the logits' dtype as the ops return it (float32 in a float32 model; in bfloat16,
transformers upcasts the logits to float32 first): the ops compute in float32 and round once.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
import torch.nn.functional as F

from tileops.ops import CrossEntropyFwdOp, LinearCrossEntropyFwdOp

IGNORE_INDEX = -100

#: The forward parameters the fused forward handles (those of Llama, Mistral, Qwen2, Qwen3 and
#: Gemma's causal LMs): it needs the first three, passes the others on to the base model, and
#: refuses a forward that takes one it does not know. The KV cache is ``cache`` in recent
#: transformers and ``past_key_values`` before (and ``cache_position`` came with it in 4.x).
NEEDED_PARAMETERS = frozenset({"input_ids", "labels", "logits_to_keep"})
KNOWN_PARAMETERS = NEEDED_PARAMETERS | {"attention_mask", "position_ids", "cache", "past_key_values", "cache_position",
                                        "inputs_embeds", "use_cache"}


def _shifted(labels: torch.Tensor, shift_labels: torch.Tensor | None) -> torch.Tensor:
    """Each token's next token, IGNORE_INDEX for the last: what transformers' ForCausalLMLoss
    compares position t's logits with."""
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
    return shift_labels.reshape(-1)


def _scaled(loss: torch.Tensor, num_items_in_batch: Any) -> torch.Tensor:
    if num_items_in_batch is None:
        return loss
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(loss.device)
    return loss / num_items_in_batch


class CausalLMLoss:
    """transformers' ``ForCausalLMLoss(logits, labels, vocab_size, num_items_in_batch=None,
    ignore_index=-100, shift_labels=None)`` on ``CrossEntropyFwdOp``. An ``ignore_index`` other
    than -100 goes to transformers' own function (passed as ``fallback``)."""

    __name__ = "CausalLMLoss"

    def __init__(self, fallback: Any, target: str | None) -> None:
        self.fallback = fallback
        self.mean = CrossEntropyFwdOp(ignore_index=IGNORE_INDEX, reduction="mean", target=target)
        self.sum = CrossEntropyFwdOp(ignore_index=IGNORE_INDEX, reduction="sum", target=target)

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor, vocab_size: int, num_items_in_batch: Any = None,
                 ignore_index: int = IGNORE_INDEX, shift_labels: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
        if ignore_index != IGNORE_INDEX:
            return self.fallback(logits, labels, vocab_size, num_items_in_batch=num_items_in_batch, ignore_index=ignore_index,
                                 shift_labels=shift_labels, **kwargs)
        target_ids = _shifted(labels, shift_labels).to(logits.device)
        op = self.mean if num_items_in_batch is None else self.sum
        loss, _ = op(logits.reshape(-1, vocab_size), target_ids)
        return _scaled(loss.float(), num_items_in_batch)


#: The names a causal LM's forward may read for the fused forward to stand in for it: the base
#: model's last hidden states projected by ``lm_head`` and handed to ``loss_function`` (in
#: transformers 4.57 and later), and Gemma 2's final soft-capping of the logits, which the op
#: applies. A forward that reads another name does something more to the logits (Cohere's
#: ``logit_scale``, Granite's ``logits_scaling``), which the fused loss would leave out.
FORWARD_NAMES = frozenset({
    "CausalLMOutputWithPast", "attentions", "cache", "past_key_values", "config", "hidden_states", "last_hidden_state",
    "lm_head", "loss_function", "model", "slice_logits_to_keep", "vocab_size", "isinstance", "int", "slice",
    "final_logit_softcapping", "torch", "tanh",
})


def _forward_signature(cls: type) -> inspect.Signature:
    return inspect.signature(inspect.unwrap(cls.forward))


def fused_forward_reason(cls: type) -> str | None:
    """Why the fused forward cannot replace ``cls``'s, or None where it can."""
    parameters = list(_forward_signature(cls).parameters.values())[1:]
    named = {parameter.name for parameter in parameters if parameter.kind is not inspect.Parameter.VAR_KEYWORD}
    takes_keywords = any(parameter.kind is inspect.Parameter.VAR_KEYWORD for parameter in parameters)
    if not takes_keywords or not NEEDED_PARAMETERS <= named or not named <= KNOWN_PARAMETERS:
        return f"its forward takes {tuple(parameter.name for parameter in parameters)}, not the ones the fused forward knows"
    code = getattr(inspect.unwrap(cls.forward), "__code__", None)
    unknown = sorted(set(code.co_names) - FORWARD_NAMES) if code is not None else ["code it cannot read"]
    if unknown:
        return f"its forward also reads {', '.join(unknown)}, which may change the logits the fused forward never computes"
    return None


@functools.cache
def fused_forward_class(cls: type) -> type:
    """``cls`` with the fused linear cross-entropy in its training forward (see the module's
    docstring). The model's ``tileops_linear_loss`` holds the ops (mean, sum)."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    signature = _forward_signature(cls)
    keywords = next(name for name, parameter in signature.parameters.items() if parameter.kind is inspect.Parameter.VAR_KEYWORD)
    # The output's field for the cache has the forward's name for it.
    cache_field = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"

    def forward(self, *args, **kwargs):
        if not self.training:  # evaluation and generation never fuse: no binding on their steps
            return super(fused, self).forward(*args, **kwargs)
        arguments = signature.bind(self, *args, **kwargs).arguments
        extra = dict(arguments.pop(keywords, {}))
        labels = arguments.pop("labels", None)
        logits_to_keep = arguments.pop("logits_to_keep", 0)
        if labels is None or not isinstance(logits_to_keep, int) or logits_to_keep != 0:
            return super(fused, self).forward(*args, **kwargs)
        del arguments["self"]
        if "cache" in signature.parameters and arguments.get("cache") is None and "past_key_values" in extra:
            # The cache's former name, which the class's forward still takes (deprecated): passed
            # on beside cache=None, transformers would keep the None and drop the cache.
            arguments["cache"] = extra.pop("past_key_values")
        if "use_cache" not in arguments and "use_cache" not in extra:
            # transformers builds a KV cache in training too (use_cache defaults to the config's,
            # on in Llama's): the cache holds a (B, H, S, D) copy of every layer's keys and
            # values until the loss is taken, where a training step's memory peaks, and the
            # attention op, in (B, S, H, D), copies them once more (H100, a 1.2B Llama at 4 x
            # 2048 tokens: 32 x 8 MiB of each kind alive at the step's peak).
            (arguments if "use_cache" in signature.parameters else extra)["use_cache"] = False
        return_dict = extra.pop("return_dict", True)
        outputs = self.model(**arguments, **extra)
        hidden_states = outputs.last_hidden_state
        hidden_states = hidden_states.reshape(-1, hidden_states.shape[-1])
        target_ids = _shifted(labels, extra.get("shift_labels")).to(hidden_states.device)
        num_items_in_batch = extra.get("num_items_in_batch")
        mean, total = self.tileops_linear_loss
        op = mean if num_items_in_batch is None else total
        weight, bias = self.lm_head.weight, self.lm_head.bias
        loss = op(hidden_states, weight.to(hidden_states.dtype), None if bias is None else bias.to(hidden_states.dtype), target_ids)
        output = CausalLMOutputWithPast(loss=_scaled(loss.float(), num_items_in_batch), logits=None,
                                        hidden_states=outputs.hidden_states, attentions=outputs.attentions,
                                        **{cache_field: getattr(outputs, cache_field, None)})
        return output if return_dict else output.to_tuple()

    # transformers reads the forward's parameters (generate() builds an attention mask only for
    # a forward that takes one): it shows the class's own.
    forward.__signature__ = signature
    fused = type(f"{cls.__name__}WithTileOPsLoss", (cls,), {"forward": forward, "__module__": __name__, "tileops_fused_loss": True,
                                                           "tileops_original": cls})
    return fused


def linear_loss_ops(target: str | None, softcap: float | None) -> tuple[LinearCrossEntropyFwdOp, LinearCrossEntropyFwdOp]:
    """The (mean, sum) ops of the fused forward."""
    options = {"ignore_index": IGNORE_INDEX, "softcap": softcap, "target": target}
    return LinearCrossEntropyFwdOp(reduction="mean", **options), LinearCrossEntropyFwdOp(reduction="sum", **options)
