"""Plain-torch implementations of the attention interfaces, forward and backward: on the CPU,
torch's own flash attention kernels; on CUDA devices and shapes the TileLang kernels do not
serve, the math reference.

The math reference computes in float32 (float64 for float64 inputs) and rounds once. GQA is
computed without copying k and v per query head: q is viewed as (B, H_kv, group, S_q, D) against
k and v of (B, H_kv, 1, S_k, D). Query rows are taken in chunks so that one chunk's scores stay
within ``SCORE_BYTES``: the S_q x S_k matrix of a long sequence is never held whole.

On the CPU the same contract is served by the kernels ``torch.nn.functional.
scaled_dot_product_attention`` runs there (``aten._scaled_dot_product_flash_attention_for_cpu``
and its backward), which take GQA as it is and return the log-sum-exp: on a (2, 64, 4, 64) call
the math reference took 168 us against torch's 22 us. Their causal mask is aligned to the top
left, so bottom-right causal masks with S_q != S_k and windows go in as an additive mask, by
chunks of query rows within ``MASK_BYTES``; a row that sees no key comes back with lse 0, which
is set to -inf here (and read back as 0 by the backward).

``general``: any narrower implementation (the TileLang kernels on Hopper) beats them. They
record no autograd history: the forward op's autograd node calls the backward op.
"""

from __future__ import annotations

import torch

from tileops.core import Kernel

from ..compute_dtypes import compute_dtype
from .interfaces import AttentionBwdInterface, AttentionCall, AttentionFwdInterface

#: The most bytes one chunk of query rows' scores (and each of their same-sized temporaries) may
#: take: 256 MiB keeps a few of them well inside any GPU's memory and the CPU's caches' reach.
SCORE_BYTES = 1 << 28

#: The most bytes one chunk of query rows' additive mask may take on the CPU path: a mask is as
#: wide as the keys, and 64 MiB of it is a small part of what the call itself moves.
MASK_BYTES = 1 << 26

flash_forward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def additive_mask(keep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``keep`` (bool) as the flash kernels take a mask: 0 where kept, -inf elsewhere, in ``dtype``."""
    return torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill_(~keep, -torch.inf)


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
        t = self.heads_first(tensor).to(compute_dtype(self.call.dtype))
        return t.unflatten(1, (self.call.heads_kv, self.group))

    def rows(self, tensor: torch.Tensor) -> torch.Tensor:
        """An lse-shaped tensor (q's middle dimensions swapped: (B, H_q, S_q) in 'bshd') as
        (B, H_kv, group, S_q), computed wide."""
        t = tensor if self.call.layout == "bshd" else tensor.transpose(1, 2)
        return t.to(compute_dtype(self.call.dtype)).unflatten(1, (self.call.heads_kv, self.group))

    def keys(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.heads_first(tensor).to(compute_dtype(self.call.dtype)).unsqueeze(2)

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
        row_bytes = max(1, batch * self.call.heads_q * s_k * torch.finfo(compute_dtype(self.call.dtype)).bits // 8)
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

    def flash_chunks(self, s_q: int, s_k: int, dtype: torch.dtype, device: torch.device):
        """(rows, additive mask or None, top-left causal) per chunk of query rows, as torch's CPU
        flash kernels take the call's masking; rows is None for a single chunk of every row (a
        slice of them all would be a view that costs the kernel more than the slicing)."""
        call = self.call
        if call.window is None and (not call.causal or s_q == s_k):
            return [(None, None, call.causal)]
        rows = max(1, MASK_BYTES // (s_k * torch.finfo(dtype).bits // 8))
        chunks = []
        for start in range(0, s_q, rows):
            stop = min(start + rows, s_q)
            mask = additive_mask(self.visible(start, stop, s_q, s_k, device), dtype)
            chunks.append((slice(start, stop) if rows < s_q else None, mask, False))
        return chunks

    def sees_nothing(self, s_q: int, s_k: int) -> int:
        """How many leading query rows see no key: those a causal mask puts before the first
        key, where S_q > S_k (a window never empties a row that causality leaves)."""
        return max(0, s_q - s_k) if self.call.causal else 0

    def lse_back(self, heads: torch.Tensor) -> torch.Tensor:
        """A (B, H_q, S_q) lse as the call's lse, float32, contiguous."""
        return (heads if self.call.layout == "bshd" else heads.transpose(1, 2)).float().contiguous()


class _TorchAttention(Kernel):
    devices = frozenset({"cpu"})
    general = True

    def __init__(self, call: AttentionCall) -> None:
        super().__init__()
        self.grouped = _Grouped(call)

    @classmethod
    def entry_for(cls, call: AttentionCall):
        return call, lambda: cls(call)


class MathAttention(_TorchAttention, AttentionFwdInterface):
    """The math reference's forward: per chunk of query rows, softmax(q k^T * scale) v with the row maximum
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


class MathAttentionBwd(_TorchAttention, AttentionBwdInterface):
    """The math reference's backward: per chunk of query rows, P = exp(s - lse) from the saved lse,
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


class TorchAttention(MathAttention):
    """The CPU forward: torch's CPU flash kernel per chunk of query rows (one chunk where no mask
    is needed)."""

    def forward(self, q, k, v):
        g = self.grouped
        qh, kh, vh = (g.heads_first(t) for t in (q, k, v))
        s_q, s_k = qh.shape[2], kh.shape[2]
        if qh.numel() == 0 or kh.numel() == 0:  # the kernel divides by these sizes
            return super().forward(q, k, v)
        outputs, sums = [], []
        for rows, mask, causal in g.flash_chunks(s_q, s_k, q.dtype, q.device):
            part = qh if rows is None else qh[:, :, rows]
            o, lse = flash_forward(part, kh, vh, 0.0, causal, attn_mask=mask, scale=g.call.scale)
            outputs.append(o)
            sums.append(lse)
        o, lse = (torch.cat(parts, 2) if len(parts) > 1 else parts[0] for parts in (outputs, sums))
        empty_rows = g.sees_nothing(s_q, s_k)
        if empty_rows:
            lse[:, :, :empty_rows] = -torch.inf
        # The kernel writes o as (B, S_q, H_q, D) in memory: 'bshd' takes it without a copy.
        return g.heads_first(o).contiguous(), g.lse_back(lse)


class TorchAttentionBwd(MathAttentionBwd):
    """The CPU backward: torch's CPU flash backward per chunk of query rows, dk and dv summed over
    the chunks in the compute dtype. A call with a gradient of lse takes the math reference (the
    kernel has no input for it); autograd passes zeros for an lse the loss does not use, which
    is no gradient."""

    def forward(self, do, q, k, v, o, lse, dlse):
        g = self.grouped
        qh, kh, vh, doh, oh = (g.heads_first(t) for t in (q, k, v, do, o))
        s_q, s_k = qh.shape[2], kh.shape[2]
        if (dlse is not None and dlse.any()) or qh.numel() == 0 or kh.numel() == 0:
            return super().forward(do, q, k, v, o, lse, dlse)
        wide = compute_dtype(q.dtype)
        heads = lse if g.call.layout == "bshd" else lse.transpose(1, 2)
        # The kernel's own forward gives a row that sees no key lse 0, and reads it back so.
        heads = torch.where(heads == -torch.inf, 0.0, heads).to(wide)
        chunks = g.flash_chunks(s_q, s_k, q.dtype, q.device)
        dqs, dk, dv = [], None, None
        for rows, mask, causal in chunks:
            do_part, q_part, o_part, lse_part = (
                (t if rows is None else t[:, :, rows]) for t in (doh, qh, oh, heads)
            )
            dq_part, dk_part, dv_part = flash_backward(
                do_part, q_part, kh, vh, o_part, lse_part, 0.0, causal, attn_mask=mask, scale=g.call.scale
            )
            dqs.append(g.heads_first(dq_part))
            if len(chunks) > 1:
                dk_part, dv_part = dk_part.to(wide), dv_part.to(wide)
            dk, dv = (dk_part, dv_part) if dk is None else (dk + dk_part, dv + dv_part)
        dq = torch.cat(dqs, 1 if g.call.layout == "bshd" else 2) if len(dqs) > 1 else dqs[0]
        dtype = q.dtype
        return dq.contiguous(), g.heads_first(dk).to(dtype).contiguous(), g.heads_first(dv).to(dtype).contiguous()


class _OnCuda:
    """Mixed into the math reference: the same computation on CUDA, for the dtypes, head sizes
    and architectures the TileLang kernels do not take."""

    devices = frozenset({"cuda"})


#: key -> class per interface: torch's flash kernels on the CPU, the math reference on CUDA.
IMPLEMENTATIONS = {
    interface: {
        "torch_cpu": cpu_class,
        "torch_cuda": type(cpu_class.__name__ + "Cuda", (_OnCuda, math_class), {"__module__": __name__}),
    }
    for interface, cpu_class, math_class in (
        (AttentionFwdInterface, TorchAttention, MathAttention),
        (AttentionBwdInterface, TorchAttentionBwd, MathAttentionBwd),
    )
}
