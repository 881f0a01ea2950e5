"""The loss of transformers causal LMs, on TileOPs.

Two parts, both set on the model instance by ``apply()``:

* ``CausalLMLoss`` replaces the model's ``loss_function`` (transformers' ``ForCausalLMLoss``):
  the labels shifted by one token, the cross-entropy of the logits on ``CrossEntropyFwdOp``,
  averaged over the tokens not ignored, or summed and divided by ``num_items_in_batch`` where the
  caller passes it (as transformers' Trainer does for gradient accumulation).
* ``fused_forward_class(cls)`` is the model's class with a forward that, in training with
  labels, never computes the logits: the last hidden states, the lm-head weight and the shifted
  labels go to ``LinearCrossEntropyFwdOp``, which projects and takes the loss a chunk of rows at a
  time. The output's ``logits`` is then None (as Liger-Kernel's patched forward). In eval mode,
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

#: The forward parameters of the causal LMs whose forward the fused one replaces (Llama,
#: Mistral, Qwen2, Qwen3, Gemma in transformers 5).
FORWARD_PARAMETERS = ("self", "input_ids", "attention_mask", "position_ids", "cache", "inputs_embeds", "labels", "use_cache",
                      "logits_to_keep", "kwargs")


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


def fused_forward_reason(cls: type) -> str | None:
    """Why the fused forward cannot replace ``cls``'s, or None where it can."""
    forward = inspect.unwrap(cls.forward)
    parameters = tuple(inspect.signature(forward).parameters)
    if parameters != FORWARD_PARAMETERS:
        return f"its forward takes {parameters[1:]}, not the ones the fused forward knows"
    return None


@functools.cache
def fused_forward_class(cls: type) -> type:
    """``cls`` with the fused linear cross-entropy in its training forward (see the module's
    docstring). The model's ``tileops_linear_loss`` holds the ops (mean, sum)."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, inputs_embeds=None, labels=None,
                use_cache=None, logits_to_keep=0, **kwargs):
        if cache is None and "past_key_values" in kwargs:
            # The cache's former name, which the class's forward still takes (deprecated): passed
            # on beside cache=None, transformers would keep the None and drop the cache.
            cache = kwargs.pop("past_key_values")
        if labels is None or not self.training or not isinstance(logits_to_keep, int) or logits_to_keep != 0:
            return super(fused, self).forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                              cache=cache, inputs_embeds=inputs_embeds, labels=labels, use_cache=use_cache,
                                              logits_to_keep=logits_to_keep, **kwargs)
        return_dict = kwargs.pop("return_dict", True)
        outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
                             inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs)
        hidden_states = outputs.last_hidden_state
        hidden_states = hidden_states.reshape(-1, hidden_states.shape[-1])
        target_ids = _shifted(labels, kwargs.get("shift_labels")).to(hidden_states.device)
        num_items_in_batch = kwargs.get("num_items_in_batch")
        mean, total = self.tileops_linear_loss
        op = mean if num_items_in_batch is None else total
        weight, bias = self.lm_head.weight, self.lm_head.bias
        loss = op(hidden_states, weight.to(hidden_states.dtype), None if bias is None else bias.to(hidden_states.dtype), target_ids)
        output = CausalLMOutputWithPast(loss=_scaled(loss.float(), num_items_in_batch), logits=None, cache=outputs.cache,
                                        hidden_states=outputs.hidden_states, attentions=outputs.attentions)
        return output if return_dict else output.to_tuple()

    fused = type(f"{cls.__name__}WithTileOPsLoss", (cls,), {"forward": forward, "__module__": __name__, "tileops_fused_loss": True,
                                                           "tileops_original": cls})
    return fused


def linear_loss_ops(target: str | None, softcap: float | None) -> tuple[LinearCrossEntropyFwdOp, LinearCrossEntropyFwdOp]:
    """The (mean, sum) ops of the fused forward."""
    options = {"ignore_index": IGNORE_INDEX, "softcap": softcap, "target": target}
    return LinearCrossEntropyFwdOp(reduction="mean", **options), LinearCrossEntropyFwdOp(reduction="sum", **options)
