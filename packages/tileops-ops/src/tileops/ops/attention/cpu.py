"""Plain-torch implementations of the attention interfaces: the math reference, forward and
backward, on the CPU and on CUDA devices and shapes the TileLang kernels do not serve.

They compute in float32 (float64 for float64 inputs) and round once. GQA is computed without
copying k and v per query head: q is viewed as (B, H_kv, group, S_q, D) against k and v of
(B, H_kv, 1, S_k, D). Query rows are taken in chunks so that one chunk's scores stay within
``SCORE_BYTES``: the S_q x S_k matrix of a long sequence is never held whole. ``general``: any
narrower implementation (the TileLang kernels on Hopper) beats them. They record no autograd
history: the forward op's autograd node calls the backward op.
"""

from __future__ import annotations

import torch

from tileops.core import Kernel

from .interfaces import AttentionBwdInterface, AttentionCall, AttentionFwdInterface

#: The most bytes one chunk of query rows' scores (and each of their same-sized temporaries) may
#: take: 256 MiB keeps a few of them well inside any GPU's memory and the CPU's caches' reach.
SCORE_BYTES = 1 << 28


def _wide(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class _Grouped:
    """The call's tensors as (B, H_kv, group, S, D) (q-shaped) and (B, H_kv, 1, S, D) (k-shaped)
    views in the compute dtype, and the way back to the call's layout."""

    def __init__(self, call: AttentionCall) -> None:
        self.call = call
        self.group = call.heads_q // call.heads_kv

    def heads_first(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor if self.call.layout == "bhsd" else tensor.transpose(1, 2)

    def queries(self, tensor: torch.Tensor) -> torch.Tensor:
        """A q-shaped tensor as (B, H_kv, group, S_q, D), computed wide."""
        t = self.heads_first(tensor).to(_wide(self.call.dtype))
        return t.unflatten(1, (self.call.heads_kv, self.group))

    def rows(self, tensor: torch.Tensor) -> torch.Tensor:
        """An lse-shaped tensor (q's middle dimensions swapped: (B, H_q, S_q) in 'bshd') as
        (B, H_kv, group, S_q), computed wide."""
        t = tensor if self.call.layout == "bshd" else tensor.transpose(1, 2)
        return t.to(_wide(self.call.dtype)).unflatten(1, (self.call.heads_kv, self.group))

    def keys(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.heads_first(tensor).to(_wide(self.call.dtype)).unsqueeze(2)

    def back(self, grouped: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """A (B, H_kv, group, S, D) result in the call's layout, contiguous, in ``dtype``."""
        heads = grouped.flatten(1, 2)
        return self.heads_first(heads).to(dtype).contiguous()

    def rows_back(self, grouped: torch.Tensor) -> torch.Tensor:
        """A (B, H_kv, group, S_q) lse as the call's lse, float32, contiguous."""
        heads = grouped.flatten(1, 2)
        return (heads if self.call.layout == "bshd" else heads.transpose(1, 2)).float().contiguous()

    def chunks(self, batch: int, s_q: int, s_k: int):
        """(start, stop) of the chunks of query rows, each within SCORE_BYTES of scores."""
        row_bytes = max(1, batch * self.call.heads_q * s_k * torch.finfo(_wide(self.call.dtype)).bits // 8)
        rows = max(1, SCORE_BYTES // row_bytes)
        return [(start, min(start + rows, s_q)) for start in range(0, s_q, rows)]

    def visible(self, start: int, stop: int, s_q: int, s_k: int, device: torch.device) -> torch.Tensor | None:
        """Which keys rows start..stop see, (rows, S_k) bool; None where every row sees every key."""
        call = self.call
        if not call.causal and call.window is None:
            return None
        i = torch.arange(start, stop, device=device)[:, None] + (s_k - s_q)
        j = torch.arange(s_k, device=device)[None, :]
        keep = torch.ones(stop - start, s_k, dtype=torch.bool, device=device)
        if call.causal:
            keep &= j <= i
        if call.window is not None:
            keep &= j >= i - call.window
        return keep

    def scores(self, q: torch.Tensor, k: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
        s = torch.matmul(q, k.transpose(-1, -2)) * self.call.scale
        return s if keep is None else s.masked_fill(~keep, -torch.inf)


class _TorchAttention(Kernel):
    devices = frozenset({"cpu"})
    general = True

    def __init__(self, call: AttentionCall) -> None:
        super().__init__()
        self.grouped = _Grouped(call)

    @classmethod
    def entry_for(cls, call: AttentionCall):
        return call, lambda: cls(call)


class TorchAttention(_TorchAttention, AttentionFwdInterface):
    """The forward: per chunk of query rows, softmax(q k^T * scale) v with the row maximum
    subtracted, and lse = log(sum) + max; rows that see no key give 0 and -inf."""

    @torch.no_grad()
    def forward(self, q, k, v):
        g = self.grouped
        qg, kg, vg = g.queries(q), g.keys(k), g.keys(v)
        batch, s_q, s_k = qg.shape[0], qg.shape[3], kg.shape[3]
        outputs, sums = [], []
        for start, stop in g.chunks(batch, s_q, s_k):
            s = g.scores(qg[:, :, :, start:stop], kg, g.visible(start, stop, s_q, s_k, q.device))
            top = s.amax(-1, keepdim=True)
            top = torch.where(torch.isfinite(top), top, 0)  # a row that sees nothing: exp(-inf - 0) = 0
            e = torch.exp(s - top)
            total = e.sum(-1, keepdim=True)
            outputs.append(torch.matmul(e, vg) / torch.where(total > 0, total, 1))
            sums.append(torch.where(total > 0, torch.log(total) + top, -torch.inf).squeeze(-1))
        o = torch.cat(outputs, 3)
        lse = torch.cat(sums, 3)
        return g.back(o, q.dtype), g.rows_back(lse)


class TorchAttentionBwd(_TorchAttention, AttentionBwdInterface):
    """The backward: per chunk of query rows, P = exp(s - lse) from the saved lse,
    dS = P (dP - delta) with delta = rowsum(do o) - dlse, then dq = dS k * scale and the
    chunk's share of dk = dS^T q * scale and dv = P^T do, summed over the group's heads."""

    @torch.no_grad()
    def forward(self, do, q, k, v, o, lse, dlse):
        g = self.grouped
        scale = g.call.scale
        qg, dog, og = g.queries(q), g.queries(do), g.queries(o)
        kg, vg = g.keys(k), g.keys(v)
        delta = (dog * og).sum(-1)
        if dlse is not None:
            delta = delta - g.rows(dlse)
        lseg = g.rows(lse)
        batch, s_q, s_k = qg.shape[0], qg.shape[3], kg.shape[3]
        dq = torch.empty_like(qg)
        dk = torch.zeros(kg.shape[:2] + kg.shape[3:], dtype=kg.dtype, device=kg.device)
        dv = torch.zeros_like(dk)
        for start, stop in g.chunks(batch, s_q, s_k):
            rows = slice(start, stop)
            keep = g.visible(start, stop, s_q, s_k, q.device)
            s = g.scores(qg[:, :, :, rows], kg, keep)
            p = torch.exp(s - lseg[:, :, :, rows, None])
            p = torch.where(torch.isfinite(s) & torch.isfinite(lseg[:, :, :, rows, None]), p, 0)
            dp = torch.matmul(dog[:, :, :, rows], vg.transpose(-1, -2))
            ds = p * (dp - delta[:, :, :, rows, None])
            dq[:, :, :, rows] = torch.matmul(ds, kg) * scale
            dk += torch.matmul(ds.transpose(-1, -2), qg[:, :, :, rows]).sum(2) * scale
            dv += torch.matmul(p.transpose(-1, -2), dog[:, :, :, rows]).sum(2)
        dtype = q.dtype
        return g.back(dq, dtype), g.back(dk.unsqueeze(2), dtype), g.back(dv.unsqueeze(2), dtype)


class _OnCuda:
    """Mixed into a CPU implementation: the same computation on CUDA, for the dtypes, head sizes
    and architectures the TileLang kernels do not take."""

    devices = frozenset({"cuda"})


#: key -> class per interface: plain torch on the CPU, and the same on CUDA.
IMPLEMENTATIONS = {
    interface: {
        "torch_cpu": cpu_class,
        "torch_cuda": type(cpu_class.__name__ + "Cuda", (_OnCuda, cpu_class), {"__module__": __name__}),
    }
    for interface, cpu_class in ((AttentionFwdInterface, TorchAttention), (AttentionBwdInterface, TorchAttentionBwd))
}
