"""Variable-length attention in plain torch: the CPU implementation, forward and backward, and the
fallback on CUDA for the calls the TileLang kernels do not take (float32, float64, other head
sizes, other GPUs).

On the CPU each sequence goes through the dense attention's CPU implementation (torch's CPU
flash kernels, ``cpu.py``), its offsets read on the host, where that costs no synchronisation
and the op has checked them: the work is the sum of each sequence's S_q x S_k (8 causal
sequences of 256 tokens: 64 ms, against 750 ms for the packed math below).

On CUDA the packed batch is computed whole, a chunk of query rows at a time (each chunk's scores within
``cpu.SCORE_BYTES``), with a mask that keeps each row to its own sequence's keys and, within
it, to its causal and sliding window. The mask comes from ``cu_seqlens`` by tensor operations
on the call's device, so nothing is read on the host: a CUDA call is captured in a graph like
the TileLang kernels' calls. Its work grows with T_q x T_k rather than the sum of each
sequence's S_q x S_k, which suits a reference and a fallback, not training. GQA is computed
without copying k and v per query head. They compute in float32 (float64 for float64 inputs)
and round once; ``general``: any narrower implementation beats them.
"""

from __future__ import annotations

import torch

from tileops.core import Kernel

from ..compute_dtypes import compute_dtype
from .cpu import SCORE_BYTES, TorchAttention, TorchAttentionBwd
from .interfaces import AttentionCall
from .varlen_interfaces import VarlenAttentionBwdInterface, VarlenAttentionCall, VarlenAttentionFwdInterface


def packed_rows(cu_seqlens: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence, position within it) of each of ``total`` packed rows, from (B + 1,) offsets;
    offsets that break the rules are clamped so that no index leaves the tensors."""
    cu = cu_seqlens.long()
    rows = torch.arange(total, device=cu.device)
    sequence = torch.searchsorted(cu[1:], rows, right=True).clamp(max=cu.shape[0] - 2)
    return sequence, rows - cu[sequence]


class _Packed:
    """One call's packed batch: which keys each chunk of query rows sees, and its scores."""

    def __init__(self, call: VarlenAttentionCall, cu_seqlens_q, cu_seqlens_k, total_q: int, total_k: int) -> None:
        self.call = call
        self.group = call.heads_q // call.heads_kv
        self.q_seq, q_pos = packed_rows(cu_seqlens_q, total_q)
        self.k_seq, self.k_pos = packed_rows(cu_seqlens_k, total_k)
        lengths_q, lengths_k = cu_seqlens_q.long().diff(), cu_seqlens_k.long().diff()
        # Each query row's position on its sequence's key axis (bottom-right aligned).
        self.q_pos = q_pos + (lengths_k - lengths_q)[self.q_seq]
        width = max(1, call.heads_q * total_k * torch.finfo(compute_dtype(call.dtype)).bits // 8)
        step = max(1, SCORE_BYTES // width)
        self.chunks = [(start, min(start + step, total_q)) for start in range(0, total_q, step)]

    def visible(self, start: int, stop: int) -> torch.Tensor:
        """(rows, T_k) bool: the keys rows start..stop see."""
        i, j = self.q_pos[start:stop, None], self.k_pos[None, :]
        keep = self.q_seq[start:stop, None] == self.k_seq[None, :]
        if self.call.causal:
            keep &= j <= i
        if self.call.window is not None:
            keep &= j >= i - self.call.window
        return keep

    def queries(self, tensor: torch.Tensor) -> torch.Tensor:
        """A q-shaped (T_q, H, D) tensor as (HK, group, T_q, D), wide."""
        return tensor.to(compute_dtype(self.call.dtype)).unflatten(1, (self.call.heads_kv, self.group)).permute(1, 2, 0, 3)

    def keys(self, tensor: torch.Tensor) -> torch.Tensor:
        """A k-shaped (T_k, HK, D) tensor as (HK, 1, T_k, D), wide."""
        return tensor.to(compute_dtype(self.call.dtype)).transpose(0, 1).unsqueeze(1)

    def rows(self, tensor: torch.Tensor) -> torch.Tensor:
        """An lse-shaped (H, T_q) tensor as (HK, group, T_q), wide."""
        return tensor.to(compute_dtype(self.call.dtype)).unflatten(0, (self.call.heads_kv, self.group))

    @staticmethod
    def back(grouped: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """(HK, group, T, D) as (T, HK * group, D) in ``dtype``, contiguous."""
        return grouped.flatten(0, 1).transpose(0, 1).to(dtype).contiguous()

    def scores(self, q: torch.Tensor, k: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        return (torch.matmul(q, k.transpose(-1, -2)) * self.call.scale).masked_fill(~keep, -torch.inf)


class _TorchVarlenAttention(Kernel):
    devices = frozenset({"cpu"})
    general = True

    def __init__(self, call: VarlenAttentionCall) -> None:
        super().__init__()
        self.call = call

    @classmethod
    def entry_for(cls, call: VarlenAttentionCall):
        return call, lambda: cls(call)


class MathVarlenAttention(_TorchVarlenAttention, VarlenAttentionFwdInterface):
    """The packed math's forward: per chunk of query rows, softmax(q k^T * scale) v over the keys each row
    sees, with the row maximum subtracted, and lse = log(sum) + max; 0 and -inf where it sees none."""

    @torch.no_grad()
    def forward(self, q, k, v, cu_seqlens_q, cu_seqlens_k):
        packed = _Packed(self.call, cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0])
        qg, kg, vg = packed.queries(q), packed.keys(k), packed.keys(v)
        outputs, sums = [], []
        for start, stop in packed.chunks:
            s = packed.scores(qg[:, :, start:stop], kg, packed.visible(start, stop))
            top = s.amax(-1, keepdim=True)
            top = torch.where(torch.isfinite(top), top, 0)  # a row that sees nothing: exp(-inf - 0) = 0
            e = torch.exp(s - top)
            total = e.sum(-1, keepdim=True)
            outputs.append(torch.matmul(e, vg) / torch.where(total > 0, total, 1))
            sums.append(torch.where(total > 0, torch.log(total) + top, -torch.inf).squeeze(-1))
        o = packed.back(torch.cat(outputs, 2), q.dtype)
        lse = torch.cat(sums, 2).flatten(0, 1).float().contiguous()
        return o, lse


class MathVarlenAttentionBwd(_TorchVarlenAttention, VarlenAttentionBwdInterface):
    """The packed math's backward: per chunk of query rows, P = exp(s - lse) from the saved lse,
    dS = P (dP - delta) with delta = rowsum(do o) - dlse, dq = dS k * scale, and the chunk's
    share of dk = dS^T q * scale and dv = P^T do, summed over the group's heads."""

    @torch.no_grad()
    def forward(self, do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, dlse):
        packed = _Packed(self.call, cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0])
        scale = self.call.scale
        qg, dog, og = packed.queries(q), packed.queries(do), packed.queries(o)
        kg, vg = packed.keys(k), packed.keys(v)
        delta = (dog * og).sum(-1)
        if dlse is not None:
            delta = delta - packed.rows(dlse)
        lseg = packed.rows(lse)
        dq = torch.empty_like(qg)
        dk = torch.zeros_like(kg[:, 0])
        dv = torch.zeros_like(dk)
        for start, stop in packed.chunks:
            rows = slice(start, stop)
            s = packed.scores(qg[:, :, rows], kg, packed.visible(start, stop))
            row_lse = lseg[:, :, rows, None]
            p = torch.where(torch.isfinite(s) & torch.isfinite(row_lse), torch.exp(s - row_lse), 0)
            dp = torch.matmul(dog[:, :, rows], vg.transpose(-1, -2))
            ds = p * (dp - delta[:, :, rows, None])
            dq[:, :, rows] = torch.matmul(ds, kg) * scale
            dk += torch.matmul(ds.transpose(-1, -2), qg[:, :, rows]).sum(1) * scale
            dv += torch.matmul(p.transpose(-1, -2), dog[:, :, rows]).sum(1)
        dtype = q.dtype
        return packed.back(dq, dtype), packed.back(dk.unsqueeze(1), dtype), packed.back(dv.unsqueeze(1), dtype)


def _sequences(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor):
    """(query rows, key rows) of each sequence that has both, as slices (offsets read on the host)."""
    offsets_q, offsets_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(offsets_q) - 1):
        rows_q, rows_k = slice(offsets_q[b], offsets_q[b + 1]), slice(offsets_k[b], offsets_k[b + 1])
        if rows_q.stop > rows_q.start and rows_k.stop > rows_k.start:
            yield rows_q, rows_k


class _PerSequence(_TorchVarlenAttention):
    """The CPU implementations: the dense CPU kernel, one sequence (a batch of one) at a time."""

    def __init__(self, call: VarlenAttentionCall) -> None:
        super().__init__(call)
        dense = AttentionCall(
            call.device, call.dtype, call.head_dim, call.heads_q, call.heads_kv, call.causal, call.window, call.scale, "bshd"
        )
        self.dense_forward, self.dense_backward = TorchAttention(dense), TorchAttentionBwd(dense)


class TorchVarlenAttention(_PerSequence, VarlenAttentionFwdInterface):
    """The CPU forward; rows of a sequence without keys keep o = 0 and lse = -inf."""

    def forward(self, q, k, v, cu_seqlens_q, cu_seqlens_k):
        o = torch.zeros_like(q)
        lse = torch.full((q.shape[1], q.shape[0]), -torch.inf, dtype=torch.float32)
        for rows_q, rows_k in _sequences(cu_seqlens_q, cu_seqlens_k):
            o_b, lse_b = self.dense_forward.forward(q[rows_q][None], k[rows_k][None], v[rows_k][None])
            o[rows_q], lse[:, rows_q] = o_b[0], lse_b[0]
        return o, lse


class TorchVarlenAttentionBwd(_PerSequence, VarlenAttentionBwdInterface):
    """The CPU backward; a gradient of lse of zeros (autograd's for an unused lse) is none."""

    def forward(self, do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, dlse):
        if dlse is not None and not dlse.any():
            dlse = None
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for rows_q, rows_k in _sequences(cu_seqlens_q, cu_seqlens_k):
            dq_b, dk_b, dv_b = self.dense_backward.forward(
                do[rows_q][None], q[rows_q][None], k[rows_k][None], v[rows_k][None], o[rows_q][None],
                lse[:, rows_q][None], None if dlse is None else dlse[:, rows_q][None],
            )
            dq[rows_q], dk[rows_k], dv[rows_k] = dq_b[0], dk_b[0], dv_b[0]
        return dq, dk, dv


class TorchVarlenAttentionCuda(MathVarlenAttention):
    """The packed math's forward on CUDA, for the calls the TileLang kernels refuse."""

    devices = frozenset({"cuda"})


class TorchVarlenAttentionBwdCuda(MathVarlenAttentionBwd):
    """The packed math's backward on CUDA, for the calls the TileLang kernels refuse."""

    devices = frozenset({"cuda"})


#: key -> class per interface: the dense CPU kernels per sequence on the CPU, the packed math on CUDA.
IMPLEMENTATIONS = {
    VarlenAttentionFwdInterface: {"torch_cpu": TorchVarlenAttention, "torch_cuda": TorchVarlenAttentionCuda},
    VarlenAttentionBwdInterface: {"torch_cpu": TorchVarlenAttentionBwd, "torch_cuda": TorchVarlenAttentionBwdCuda},
}
