"""The ops of a transformer layer on the CPU, forward and backward, against the torch code they
stand for, in one run and one table.

    uv run --frozen python -P tools/bench_cpu_training.py            # the shapes of a small model
    uv run --frozen python -P tools/bench_cpu_training.py --tokens 2048 --hidden 1024

Each row is one autograd step as a training loop runs it: the op (or torch's code) on inputs that
require grad, then their gradients for given gradients of its outputs. Times are the best of ``--loops``
loops of ``--calls`` steps, the TileOPs and torch sides of a row interleaved, float32. Installed
backends take part as in any call.
"""

from __future__ import annotations

import argparse
import math
import time

import torch
import torch.nn.functional as F


def _leaf(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, requires_grad=True)


def _step(function, inputs):
    """One forward of ``function`` and the gradients of its inputs for random (contiguous, as a
    layer above gives them) gradients of its outputs."""
    first = function(*inputs)
    gradients = [torch.randn_like(o) for o in (first if isinstance(first, tuple) else (first,))]

    def step():
        outputs = function(*inputs)
        torch.autograd.grad(outputs, inputs, gradients)

    return step


def rows(tokens: int, hidden: int, heads: int, kv_heads: int, intermediate: int, vocab: int) -> list:
    """(name, TileOPs step, torch step) for each op of a layer at these sizes."""
    from tileops.ops import CrossEntropyFwdOp
    from tileops.ops.activation import SwiGLUFwdOp
    from tileops.ops.attention import AttentionFwdOp
    from tileops.ops.norm import LayerNormFwdOp, RMSNormFwdOp
    from tileops.ops.rope import RotaryEmbeddingFwdOp

    head_dim = hidden // heads
    batch, seq = 2, tokens // 2
    x, weight, bias = _leaf(batch, seq, hidden), torch.nn.Parameter(torch.randn(hidden)), torch.nn.Parameter(torch.randn(hidden))
    gate, up = _leaf(batch, seq, intermediate), _leaf(batch, seq, intermediate)
    q, k, v = _leaf(batch, seq, heads, head_dim), _leaf(batch, seq, kv_heads, head_dim), _leaf(batch, seq, kv_heads, head_dim)
    cos, sin = torch.randn(seq, head_dim), torch.randn(seq, head_dim)
    positions = torch.arange(seq).expand(batch, seq)
    logits, targets = _leaf(tokens, vocab), torch.randint(0, vocab, (tokens,))

    def torch_rope(q, k):
        c, s = cos[positions].unsqueeze(2), sin[positions].unsqueeze(2)
        half = head_dim // 2

        def rotate(t):
            return torch.cat((-t[..., half:], t[..., :half]), -1)

        return q * c + rotate(q) * s, k * c + rotate(k) * s

    def torch_attention(q, k, v):
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True)
        return o.transpose(1, 2)

    rms, layer, swiglu, rope = RMSNormFwdOp((hidden,), 1e-6), LayerNormFwdOp((hidden,)), SwiGLUFwdOp(), RotaryEmbeddingFwdOp()
    attention, cross_entropy = AttentionFwdOp(causal=True), CrossEntropyFwdOp()
    return [
        (f"RMSNorm {tuple(x.shape)}", _step(lambda x, w: rms(x, w), (x, weight)),
         _step(lambda x, w: F.rms_norm(x, (hidden,), w, 1e-6), (x, weight))),
        (f"LayerNorm {tuple(x.shape)}", _step(lambda x, w, b: layer(x, w, b), (x, weight, bias)),
         _step(lambda x, w, b: F.layer_norm(x, (hidden,), w, b), (x, weight, bias))),
        (f"SwiGLU {tuple(gate.shape)}", _step(lambda g, u: swiglu(g, u), (gate, up)), _step(lambda g, u: F.silu(g) * u, (gate, up))),
        (f"RoPE q {tuple(q.shape)} k {tuple(k.shape)}", _step(lambda q, k: rope(q, k, cos, sin, positions), (q, k)),
         _step(torch_rope, (q, k))),
        (f"attention causal {tuple(q.shape)}", _step(lambda q, k, v: attention(q, k, v)[0], (q, k, v)), _step(torch_attention, (q, k, v))),
        (f"cross-entropy {tuple(logits.shape)}", _step(lambda z: cross_entropy(z, targets)[0], (logits,)),
         _step(lambda z: F.cross_entropy(z, targets), (logits,))),
    ]


def best_us(steps, calls: int, loops: int) -> list[float]:
    """The best per-step time of each of ``steps``, their loops interleaved."""
    best = [math.inf] * len(steps)
    for step in steps:
        step()  # the first call builds and binds
    for _ in range(loops):
        for i, step in enumerate(steps):
            started = time.perf_counter()
            for _ in range(calls):
                step()
            best[i] = min(best[i], (time.perf_counter() - started) / calls * 1e6)
    return best


def main(argv: list[str] | None = None) -> str:
    """Run the benchmark; print the table and return it."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=512, help="tokens of a step, in two sequences (default 512)")
    parser.add_argument("--hidden", type=int, default=512, help="hidden size (default 512)")
    parser.add_argument("--heads", type=int, default=8, help="query heads (default 8)")
    parser.add_argument("--kv-heads", type=int, default=2, help="key/value heads (default 2)")
    parser.add_argument("--intermediate", type=int, default=1376, help="MLP intermediate size (default 1376)")
    parser.add_argument("--vocab", type=int, default=2000, help="vocabulary (default 2000)")
    parser.add_argument("--calls", type=int, default=10, help="steps per timed loop (default 10)")
    parser.add_argument("--loops", type=int, default=15, help="timed loops per side (default 15)")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    lines = [
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, float32; microseconds per forward+backward step",
        f"{'op':44s} {'TileOPs':>10s} {'torch':>10s} {'ratio':>7s}",
    ]
    print("\n".join(lines), flush=True)
    for name, mine, theirs in rows(args.tokens, args.hidden, args.heads, args.kv_heads, args.intermediate, args.vocab):
        ours, torchs = best_us([mine, theirs], args.calls, args.loops)
        lines.append(f"{name:44s} {ours:10.1f} {torchs:10.1f} {ours / torchs:7.2f}")
        print(lines[-1], flush=True)
    return "\n".join(lines)


if __name__ == "__main__":
    main()
