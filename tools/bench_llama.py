"""End-to-end benchmark of a Llama-architecture transformers model: unpatched, Liger-Kernel's
patch (where installed) and TileOPs' patch, eager and under ``torch.compile``, in one run and one
table.

    uv run --frozen python -P tools/bench_llama.py              # ~1B Llama, bfloat16, needs a CUDA GPU
    uv run --frozen python -P tools/bench_llama.py --quick      # a tiny model: checks the code paths (any device)

The model is built from a config with random weights (nothing is downloaded): about 1.2B
parameters (hidden 2048, 16 layers, 32 query and 8 key/value heads, intermediate 8192,
vocabulary 128256, as Llama 3.2 1B). For each variant it measures, on the same inputs:

* a training step (forward with labels, backward, AdamW step) at ``--seq`` tokens per sequence
  and ``--batch`` sequences: the best time of ``--repeats`` steps after a warm-up, the peak
  memory the step allocates, and the memory the forward leaves for the backward (what autograd
  saved, the loss's gradients included: where a variant's peak differs, this says whether the
  forward's tensors or the backward's temporaries make the difference);
* a prefill (a forward of the batch without labels, no gradients): tokens per second;
* decode: ``--new-tokens`` greedy tokens after a short prompt with ``generate``, tokens per
  second. The compiled variants decode with a static cache (``cache_implementation="static"``,
  which transformers compiles with CUDA graphs); the eager ones with the dynamic cache.

``--peak-breakdown`` adds, for each variant, what its training step holds at its peak of memory:
the allocations alive then, grouped by size and by the lines that made them (``memory_peak``).
``--kernel-profile N`` adds, for each variant, the N kernels that took the most of one training
step's and one prefill's GPU time (torch.profiler; on a CPU, the N operators that took the most
CPU time): where two variants' times differ, which kernels make the difference.

Variants: ``eager`` and ``compile`` (unpatched), ``liger`` (``apply_liger_kernel_to_llama`` on
the instance), ``tileops`` and ``tileops-compile`` (``tileops.integrations.transformers.apply``).
Each variant builds its own model from the same seed, in an interpreter of its own: Liger-Kernel's
patch also replaces classes and functions of transformers' Llama module, so every model built
after it in the same process would run on them. The patch column says how many parts TileOPs
replaced and which kinds it left.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import torch

from tileops.core.timing import best_call_times_us

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the tools beside this script
import memory_peak

FULL = {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
        "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192, "tie_word_embeddings": True}
QUICK = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 128, "max_position_embeddings": 256}
VARIANTS = ("eager", "compile", "liger", "tileops", "tileops-compile")


def _best_seconds(function, device: torch.device, repeats: int) -> float:
    """The best of ``repeats`` timed calls of ``function`` after one untimed (compilation, kernel
    builds, autotuning), the device's work included: the method of ``tileops bench``'s call times."""
    synchronize = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else None
    (microseconds,) = best_call_times_us([function], calls=1, loops=repeats, synchronize=synchronize)
    return microseconds / 1e6


def build(variant: str, config, dtype: torch.dtype, device: torch.device) -> tuple[torch.nn.Module, str]:
    """The model of one variant, and a line saying what was patched."""
    import transformers

    torch.manual_seed(0)
    # Built on the device: initialising a billion parameters on the host takes minutes.
    with device:
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    note = "unpatched"
    if variant == "liger":
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        apply_liger_kernel_to_llama(model=model)
        note = "apply_liger_kernel_to_llama"
    elif variant.startswith("tileops"):
        import tileops.integrations.transformers as tileops_hf

        report = tileops_hf.apply(model)
        left = Counter(part.kind for part in report.left)
        note = f"{len(report.replaced)} parts replaced, {len(report.left)} left"
        if left:
            note += " (" + ", ".join(f"{kind} {count}" for kind, count in sorted(left.items())) + ")"
    return model, note


def top_kernels(function, device: torch.device, count: int) -> str:
    """The ``count`` kernels that took the most device time in one call of ``function`` (on a
    CPU: the operators that took the most CPU time, each counted without those it called), with
    the total, as lines of text."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as profiler:
        function()
        if cuda:
            torch.cuda.synchronize(device)
    time_of = (lambda event: event.self_device_time_total) if cuda else (lambda event: event.self_cpu_time_total)
    events = sorted((e for e in profiler.key_averages() if time_of(e) > 0), key=time_of, reverse=True)
    total_ms = sum(time_of(e) for e in events) / 1e3
    lines = [f"{total_ms:.2f} ms of {'GPU' if cuda else 'CPU'} time in {sum(e.count for e in events)} calls; the largest:"]
    lines += [f"  {time_of(e) / 1e3:9.2f} ms {e.count:5d} x {e.key[:110]}" for e in events[:count]]
    return "\n".join(lines)


def measure(variant: str, config, args, device: torch.device) -> dict:
    dtype = getattr(torch, args.dtype)
    model, note = build(variant, config, dtype, device)
    compiled = variant.endswith("compile")
    step_model = torch.compile(model) if compiled else model
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq), generator=generator).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda")

    held = []  # memory allocated between the forward and the backward, per step

    def train_step() -> None:
        model.train()
        loss = step_model(ids, labels=ids).loss
        if device.type == "cuda":
            held.append(torch.cuda.memory_allocated(device))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    train_step()
    base = None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    step = _best_seconds(train_step, device, args.repeats)
    # torch counts the allocations of CUDA devices only: elsewhere the columns say so.
    peak = (torch.cuda.max_memory_allocated(device) - base) / 2**30 if base is not None else None
    forward_held = (held[-1] - base) / 2**30 if base is not None else None
    peak_sources = None
    if args.peak_breakdown and device.type == "cuda":
        with memory_peak.recording(device.index or 0) as events:
            train_step()
        peak_sources = memory_peak.breakdown(memory_peak.peak_allocations(events))
    profiles = {}
    if args.kernel_profile:
        profiles["training step"] = top_kernels(train_step, device, args.kernel_profile)
    optimizer.state.clear()

    def prefill() -> None:
        model.eval()
        with torch.no_grad():
            step_model(ids)

    prefill_seconds = _best_seconds(prefill, device, args.repeats)
    if args.kernel_profile:
        profiles["prefill"] = top_kernels(prefill, device, args.kernel_profile)

    prompt = ids[:, : args.prompt]
    options = {"max_new_tokens": args.new_tokens, "min_new_tokens": args.new_tokens, "do_sample": False, "pad_token_id": 0}
    if compiled:
        options["cache_implementation"] = "static"

    def decode() -> None:
        model.eval()
        with torch.no_grad():
            model.generate(prompt, **options)

    decode_seconds = _best_seconds(decode, device, args.repeats)
    return {"variant": variant, "note": note, "step_ms": step * 1e3, "peak_gib": peak, "held_gib": forward_held,
            "prefill_tok_s": args.batch * args.seq / prefill_seconds, "decode_tok_s": args.batch * args.new_tokens / decode_seconds,
            "peak_sources": peak_sources, "profiles": profiles}


def table(rows: list[dict]) -> str:
    lines = ["| variant | training step (ms) | step peak memory (GiB) | held for the backward (GiB) | prefill (tokens/s) "
             "| decode (tokens/s) | patch |",
             "| --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['variant']} | | | | | | not run: {row['error']} |")
            continue
        peak, held = ("not measured" if row[key] is None else f"{row[key]:.2f}" for key in ("peak_gib", "held_gib"))
        lines.append(f"| {row['variant']} | {row['step_ms']:.1f} | {peak} | {held} | {row['prefill_tok_s']:.0f} | "
                     f"{row['decode_tok_s']:.1f} | {row['note']} |")
    return "\n".join(lines)


class VariantFailed(RuntimeError):
    """A variant's measuring process failed; the message is its last line of error output."""


def measure_apart(variant: str, args: argparse.Namespace) -> dict:
    """``measure()`` of one variant in a fresh interpreter running this script (see the module's
    docstring); its error, if any, raised here with the child's last line of error output."""
    command = [sys.executable, "-P", __file__, "--measure-one", variant, "--batch", str(args.batch), "--seq", str(args.seq),
               "--prompt", str(args.prompt), "--new-tokens", str(args.new_tokens), "--repeats", str(args.repeats),
               "--dtype", args.dtype, "--device", args.device] + (["--quick"] if args.quick else []) + (
               ["--peak-breakdown"] if args.peak_breakdown else []) + (
               ["--kernel-profile", str(args.kernel_profile)] if args.kernel_profile else [])
    child = subprocess.run(command, capture_output=True, text=True)
    # The child's log (kernel builds, library warnings) is the run's log too.
    sys.stderr.write(child.stderr)
    if child.returncode != 0:
        lines = [line for line in child.stderr.strip().splitlines() if line.strip()]
        raise VariantFailed(lines[-1] if lines else f"the measuring process exited with status {child.returncode}")
    return json.loads(child.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny model and short sequences: checks the code paths")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    parser.add_argument("--batch", type=int, default=None, help="sequences per step (default 4; 2 with --quick)")
    parser.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 2048; 16 with --quick)")
    parser.add_argument("--prompt", type=int, default=None, help="decode prompt tokens (default 128; 4 with --quick)")
    parser.add_argument("--new-tokens", type=int, default=None, help="decoded tokens (default 128; 4 with --quick)")
    parser.add_argument("--repeats", type=int, default=None, help="timed repeats after a warm-up (default 5; 1 with --quick)")
    parser.add_argument("--dtype", default=None, help="bfloat16 (default) or float32 (default with --quick off CUDA)")
    parser.add_argument("--device", default=None, help="default: cuda where present, else cpu")
    parser.add_argument("--peak-breakdown", action="store_true",
                        help="after the table, what each variant's training step holds at its peak of memory (CUDA)")
    parser.add_argument("--kernel-profile", type=int, default=0, metavar="N",
                        help="after the table, the N kernels that took the most of each variant's training step and prefill")
    parser.add_argument("--measure-one", choices=VARIANTS, help=argparse.SUPPRESS)  # the child of measure_apart()
    args = parser.parse_args(argv)
    quick = {"batch": 2, "seq": 16, "prompt": 4, "new_tokens": 4, "repeats": 1}
    full = {"batch": 4, "seq": 2048, "prompt": 128, "new_tokens": 128, "repeats": 5}
    for name, value in (quick if args.quick else full).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    args.device = str(device)
    if args.dtype is None:
        args.dtype = "float32" if args.quick and device.type == "cpu" else "bfloat16"
    if not args.quick and device.type != "cuda":
        parser.error("the full benchmark needs a CUDA GPU; --quick runs a tiny model anywhere")
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")

    import transformers

    config = transformers.LlamaConfig(**(QUICK if args.quick else FULL))
    if args.measure_one:
        row = json.dumps(measure(args.measure_one, config, args, device))
        print(row)
        return row
    rows = []
    for variant in variants:
        # One variant's failure (Liger-Kernel not installed, a compile error, out of memory) is
        # its row's; the others still run. Each row is printed as it is measured, so that a run
        # stopped part way keeps what it measured.
        try:
            rows.append(measure_apart(variant, args))
        except Exception as error:  # noqa: BLE001 - reported in the table
            message = str(error).strip().splitlines()[0] if str(error).strip() else ""
            if not isinstance(error, VariantFailed):
                message = f"{type(error).__name__}: {message}"
            rows.append({"variant": variant, "error": message[:300]})
        print(table(rows[-1:]).splitlines()[-1], flush=True)
    text = (f"Llama {'(quick) ' if args.quick else ''}on {device.type}, {args.dtype}, batch {args.batch} x seq {args.seq}; "
            f"decode {args.new_tokens} tokens after {args.prompt}\n\n" + table(rows))
    for row in rows:
        if row.get("peak_sources"):
            text += f"\n\n{row['variant']}: the training step's peak, " + row["peak_sources"]
        for what, kernels in row.get("profiles", {}).items():
            text += f"\n\n{row['variant']}, one {what}: {kernels}"
    print(text)
    return text


if __name__ == "__main__":
    main()
