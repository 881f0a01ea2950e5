"""Every causal-LM architecture the installed transformers ships, patched by
``tileops.integrations.transformers.apply`` and compared with itself unpatched, on the CPU.

    uv run --frozen python -P tools/check_transformers_models.py              # all of them (minutes)
    uv run --frozen python -P tools/check_transformers_models.py llama cohere # some, by model type

The patch must replace only what computes as the original does, whatever the architecture: the
tests cover the architectures it names and a few outside them, and this tool the rest, as a new
transformers release brings them. For each model type it builds a two-layer model from the
type's config with small sizes (random weights, dropout off, nothing downloaded), then compares,
in float32: the logits in eval mode, three greedy tokens of ``generate()`` (through the KV
cache), and in training with labels the loss and every parameter's gradient (relative to the
largest element of the unpatched one; gradients that are round-off there, such as a key
projection's bias, whose true gradient is zero, are skipped).

A type whose unpatched model cannot be built or run from such a config (a composite config, a
required option the small sizes contradict, more than ``--max-parameters``, longer than
``--seconds``) is listed as skipped with the reason; it says nothing about the patch. Needs a
system with SIGALRM (Linux, macOS). The exit status is 1 where a patched model
differs or fails, and the table says which and where.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import signal
import sys
import warnings

import torch

SIZES = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 101,
         "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}  # the defaults' ids are past this vocabulary
#: float32 on the CPU: the patched ops compute in float32 and round once, as torch's do here.
LOGITS_TOLERANCE = 1e-4
GRADIENT_TOLERANCE = 1e-3  # relative to the largest element of the unpatched gradient
ROUND_OFF = 1e-6  # an unpatched gradient no larger than this is round-off


class Skipped(Exception):
    """The unpatched model of a type cannot be built or run from the small config."""


class TookTooLong(Exception):
    """A model ran past the time one type is given."""


@contextlib.contextmanager
def time_limit(seconds: int):
    """Raise TookTooLong in the main thread after ``seconds`` (a few architectures' small models
    run for minutes on a CPU, growing their memory all along)."""
    def stop(signum, frame):
        raise TookTooLong

    previous = signal.signal(signal.SIGALRM, stop)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def small_config(model_type: str):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config = CONFIG_MAPPING[model_type](**SIZES)
    if config.get_text_config() is not config:
        raise Skipped("a composite config (its text model has a type of its own)")
    for name, value in vars(config).items():
        # Dropout off: the attention ops take training calls without it (with it they go to sdpa).
        if ("dropout" in name or name.endswith("pdrop")) and isinstance(value, float):
            setattr(config, name, 0.0)
    return config


def generated(model, ids: torch.Tensor) -> torch.Tensor:
    """Three greedy tokens after ``ids``, through the model's KV cache."""
    model.eval()
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False, pad_token_id=0)


def run(model, ids: torch.Tensor):
    """(eval logits, training loss, gradients by parameter name) of one model on ``ids``."""
    model.eval()
    with torch.no_grad():
        logits = model(ids).logits
    model.train()
    torch.manual_seed(2)  # any dropout left draws the same masks in both models
    loss = model(ids, labels=ids).loss
    loss.backward()
    return logits, loss.detach(), {name: p.grad for name, p in model.named_parameters()}


def check(model_type: str, max_parameters: int, seconds: int) -> tuple[str, str]:
    """(outcome, detail) of one model type: ``ok``, ``differs``, ``fails`` or ``skipped``."""
    import transformers

    from tileops.integrations.transformers import apply

    ids = torch.randint(3, SIZES["vocab_size"] - 1, (2, 12), generator=torch.Generator().manual_seed(1))
    try:
        with time_limit(seconds):
            config = small_config(model_type)
            torch.manual_seed(0)
            reference = transformers.AutoModelForCausalLM.from_config(config)
            count = sum(p.numel() for p in reference.parameters())
            if count > max_parameters:
                raise Skipped(f"{count} parameters at the small sizes")
            model = copy.deepcopy(reference)
            expected = run(reference, ids)
        try:
            with time_limit(seconds):
                expected_tokens = generated(reference, ids)
        except Exception:  # noqa: BLE001 - the unpatched model does not generate: compared without
            expected_tokens = None
    except Skipped as reason:
        return "skipped", str(reason)
    except TookTooLong:
        return "skipped", f"the unpatched model ran past {seconds} s"
    except Exception as error:  # noqa: BLE001 - transformers' own failure on the small config
        return "skipped", f"unpatched: {type(error).__name__}: {str(error)[:100]}"
    try:
        with time_limit(seconds):
            report = apply(model)
            logits, loss, gradients = run(model, ids)
            tokens = None if expected_tokens is None else generated(model, ids)
    except TookTooLong:
        return "fails", f"the patched model ran past {seconds} s"
    except Exception as error:  # noqa: BLE001 - the patched model must run wherever the unpatched one does
        return "fails", f"{type(error).__name__}: {str(error)[:200]}"
    problems = []
    if not torch.allclose(logits, expected[0], rtol=LOGITS_TOLERANCE, atol=LOGITS_TOLERANCE):
        problems.append(f"logits by {(logits - expected[0]).abs().max().item():.1e}")
    if not torch.allclose(loss, expected[1], rtol=LOGITS_TOLERANCE, atol=LOGITS_TOLERANCE):
        problems.append(f"loss by {(loss - expected[1]).abs().item():.1e}")
    for name, want in expected[2].items():
        got = gradients[name]
        if want is None or got is None:
            if want is not got:
                problems.append(f"{name}'s gradient is {'missing' if got is None else 'extra'}")
            continue
        scale = want.abs().max().item()
        if scale > ROUND_OFF and (got - want).abs().max().item() > GRADIENT_TOLERANCE * scale:
            problems.append(f"{name}'s gradient by {(got - want).abs().max().item() / scale:.1e} of its largest element")
    if tokens is not None and not torch.equal(tokens, expected_tokens):
        problems.append("generate() picks other tokens")
    if problems:
        return "differs", "; ".join(problems[:3])
    replaced = sorted({r.original for r in report.replaced})
    unchecked = "" if tokens is not None else "; generate() not compared: the unpatched model's failed"
    return "ok", f"{len(report.replaced)} replaced ({', '.join(replaced)}){unchecked}"


def transformers_version() -> str:
    import transformers

    return transformers.__version__


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_types", nargs="*", help="transformers model types (default: every causal LM's)")
    parser.add_argument("--max-parameters", type=int, default=40_000_000,
                        help="skip a type whose small model has more (a mixture of many experts)")
    parser.add_argument("--seconds", type=int, default=60, help="the time each model (unpatched, patched) is given")
    args = parser.parse_args(argv)
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    from transformers.utils import logging

    logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    unknown = sorted(set(args.model_types) - set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES))
    if unknown:
        parser.error(f"not causal-LM model types of transformers {transformers_version()}: {', '.join(unknown)}")
    types = args.model_types or sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    counts: dict[str, int] = {}
    print(f"transformers {transformers_version()}, torch {torch.__version__}, float32 on the CPU\n")
    print("| model type | outcome | detail |\n| --- | --- | --- |")
    for model_type in types:
        outcome, detail = check(model_type, args.max_parameters, args.seconds)
        counts[outcome] = counts.get(outcome, 0) + 1
        print(f"| {model_type} | {outcome} | {detail.replace('|', '/')} |", flush=True)
    print("\n" + ", ".join(f"{count} {outcome}" for outcome, count in sorted(counts.items())))
    return 1 if counts.get("differs") or counts.get("fails") else 0


if __name__ == "__main__":
    sys.exit(main())
