"""A small Llama-architecture transformers model (random weights, nothing downloaded) as
transformers builds it and as ``apply`` patches it, side by side: what the patch replaced and
left, the time of a forward and of a training step on each side (``tileops.core.timing``'s
host-inclusive method: the best of a few loops, the sides taking turns), and how far their
results are apart. ``tileops demo`` ends with it.

transformers is optional: where it is not installed, ``compare`` says so instead.
"""

from __future__ import annotations

import copy
import functools
import math
from typing import Any

import torch

from tileops.core.timing import best_call_times_us

#: A Llama small enough for a CPU: every kind of part the patch replaces (RMSNorm, gated MLP,
#: rotary q/k, GQA attention, the causal LM loss) at a size that runs in milliseconds.
SMALL_LLAMA = {
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 1000,
    "max_position_embeddings": 512,
}
BATCH, TOKENS = 2, 128
REPEATS = 5
SKIPPED = "transformers is not installed (pip install 'tileops[transformers]')"


def compare(device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """Both sides' results and times (see the module's docstring), or ``{"skipped": why}``."""
    try:
        import transformers
    except ImportError:
        return {"skipped": SKIPPED}
    from tileops.integrations.transformers import apply

    torch.manual_seed(0)
    plain = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL_LLAMA)).to(device=device, dtype=dtype)
    patched = copy.deepcopy(plain)
    report = apply(patched)
    ids = torch.randint(0, SMALL_LLAMA["vocab_size"], (BATCH, TOKENS), generator=torch.Generator().manual_seed(1)).to(device)
    models = {"transformers": plain, "tileops": patched}
    logits = {}
    for side, model in models.items():
        model.eval()
        with torch.no_grad():
            logits[side] = model(ids).logits.float()
    forward_us = _times_us([functools.partial(_forward, model, ids) for model in models.values()], device)
    for model in models.values():
        model.train()
    losses = {side: _training_step(model, ids) for side, model in models.items()}
    step_us = _times_us([functools.partial(_training_step, model, ids) for model in models.values()], device)
    sides = {
        side: {"forward_ms": forward / 1e3, "training_step_ms": step / 1e3, "loss": losses[side]}
        for side, forward, step in zip(models, forward_us, step_us)
    }
    difference = float((logits["tileops"] - logits["transformers"]).abs().max())
    largest = float(logits["transformers"].abs().max())
    return {
        "model": f"LlamaForCausalLM, {SMALL_LLAMA['num_hidden_layers']} layers, hidden {SMALL_LLAMA['hidden_size']}, "
        f"{SMALL_LLAMA['num_attention_heads']}/{SMALL_LLAMA['num_key_value_heads']} heads, vocabulary "
        f"{SMALL_LLAMA['vocab_size']}, random weights",
        "tokens": [BATCH, TOKENS],
        "report": str(report),
        "replaced": len(report.replaced),
        "left": len(report.left),
        "sides": sides,
        "max_logit_difference": difference,
        "largest_logit": largest,
        "finite": math.isfinite(difference) and math.isfinite(sides["tileops"]["loss"]),
    }


def describe(result: dict[str, Any], device: torch.device, dtype: torch.dtype) -> str:
    """``compare``'s result as the lines ``tileops demo`` prints (also ``{"failed": why}``, which
    the demo records where ``compare`` raised)."""
    lines = ["model (a transformers model, patched by tileops.integrations.transformers.apply):"]
    if "skipped" in result or "failed" in result:
        verdict = "skipped" if "skipped" in result else "failed"
        return "\n".join([*lines, f"  {verdict}: {result[verdict]}"])
    batch, tokens = result["tokens"]
    lines.append(f"  {result['model']}; {batch} x {tokens} tokens, {str(dtype).removeprefix('torch.')} on {device}")
    lines += ["  " + line for line in result["report"].splitlines()]
    lines.append(f"  {'side':<14}{'forward (ms)':>14}{'training step (ms)':>20}{'loss':>10}")
    for side, times in result["sides"].items():
        lines.append(f"  {side:<14}{times['forward_ms']:>14.2f}{times['training_step_ms']:>20.2f}{times['loss']:>10.4f}")
    lines.append(
        f"  logits: largest difference between the sides {result['max_logit_difference']:.2g} "
        f"(the largest logit is {result['largest_logit']:.2g})"
    )
    return "\n".join(lines)


def _forward(model: torch.nn.Module, ids: torch.Tensor) -> None:
    with torch.no_grad():
        model(ids)


def _training_step(model: torch.nn.Module, ids: torch.Tensor) -> float:
    """A forward with labels and its backward; the loss."""
    loss = model(ids, labels=ids).loss
    loss.backward()
    model.zero_grad(set_to_none=True)
    return float(loss.detach())


def _times_us(functions: list, device: torch.device) -> list[float]:
    """Each function's time, as ``tileops bench`` times calls: the best of ``REPEATS`` loops after
    a warm-up (kernel builds), the sides taking turns, the device synchronised after each."""
    synchronize = functools.partial(torch.cuda.synchronize, device) if device.type == "cuda" else None
    return best_call_times_us(functions, calls=1, loops=REPEATS, synchronize=synchronize)
