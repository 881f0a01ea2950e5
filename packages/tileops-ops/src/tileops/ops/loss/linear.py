"""The fused linear cross-entropy: ``LinearCrossEntropyFwdOp`` and its backward op.

The logits hidden_states @ weight.T (+ bias) are computed a chunk of rows at a time through
``torch.nn.functional.linear`` (cuBLAS on CUDA), so that no more than one chunk's logits exist at
once. Each chunk runs the cross-entropy rows step (its rows' loss and lse); a differentiated call
also runs the grad step in place over the chunk's logits (a unit loss gradient: 1 per row for
'sum', 1 / count for 'mean') and accumulates the gradients of hidden_states (this chunk's rows), weight
and bias by GEMM. They are saved as the backward op's ``grad_*`` inputs, and the backward
multiplies them in place by the incoming gradient: the logits are computed once per training
step, and the weight's gradient exists once (a scaled copy would be a second weight-sized tensor
beside the saved one, at the start of the backward pass, where a training step's memory peaks).
Only the gradients of inputs that require grad are computed (``saved_for`` in the manifest): a
frozen lm-head, as LoRA fine-tuning keeps it, costs no weight-gradient GEMMs and no (V, H)
tensor, and a model without a bias no column sums of each chunk's logits' gradient.

Chunk size (``chunk_rows``) weighs time against memory: a chunk's weight-gradient GEMM reads and
writes the whole (V, H) gradient, so a chunk needs enough rows for that GEMM to be bound by its
multiply-adds; its logits may take as much memory as the hidden states themselves or a quarter
of the weight's gradient, memory the call holds anyway. The weight's gradient accumulates in the
weight's dtype (as the GEMMs write it), the bias's in float32.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..compute_dtypes import compute_dtype
from ..vector_access import row_alignment
from .interfaces import CrossEntropyGradInterface, CrossEntropyRowsInterface
from .ops import _ReducedLossOp, check_targets


#: Rows a chunk's weight-gradient GEMM needs to be bound by its multiply-adds, not by reading and
#: writing the (V, H) gradient it accumulates into: 2 r V H flops against 2 V H itemsize bytes is
#: r / itemsize flops a byte, and a Hopper GPU's ridge (cuBLAS bf16 at about 800 TFLOP/s over
#: 3.35-4.8 TB/s of HBM) is 170-240 flops a byte: 340-480 rows in 16-bit types. 384 rows (three
#: 128-row GEMM tiles) are about the H200's ridge; on an H100 such a chunk's GEMM is a little short of it.
#: H100, bf16, a 1.2B Llama's training step (V 128256, H 2048, 8192 tokens): chunks of 131 rows
#: spent 57 ms of its 176 in the loss's GEMMs, about twice Liger-Kernel's 32 chunks of 256; with
#: 512-row chunks the loss's forward, where one chunk's 125 MiB of logits join the weight's
#: gradient, became the step's peak of memory, 30 MiB above Liger-Kernel's.
GEMM_BOUND_ROWS = 384


def chunk_rows(rows: int, hidden_size: int, vocab: int) -> int:
    """Rows per chunk, at least one: ``GEMM_BOUND_ROWS`` where its (rows, V) logits take at most a
    quarter of the (V, H) weight gradient's memory (else the rows that do), or more where the
    logits still fit in the memory of the (N, H) hidden states."""
    fit_hidden_states = math.ceil(rows * hidden_size / vocab)
    gemm_bound = min(GEMM_BOUND_ROWS, hidden_size // 4)
    return max(1, min(rows, max(fit_hidden_states, gemm_bound)))


class _LinearLossOp(_ReducedLossOp):
    kernel_interfaces = (CrossEntropyRowsInterface, CrossEntropyGradInterface)

    def call_specs(self, device, inputs):
        """The call specs a call with ``inputs`` (descriptions) gets: those of its chunks' logits,
        which are hidden_states' dtype, V wide and allocated by torch (16-byte aligned)."""
        hidden_states, weight, target_ids = inputs["hidden_states"], inputs["weight"], inputs["target_ids"]
        vocab = weight.shape[0]
        target_dtype = target_ids.dtype if target_ids.dtype in (torch.int64, torch.int32) else torch.int64
        # The chunk's logits: no tensor to read a pointer of; torch allocates them aligned.
        fields = (device, hidden_states.dtype, vocab, target_dtype, *row_alignment(device, vocab, hidden_states.dtype))
        return {interface: self.call_spec(interface, *fields) for interface in self.kernel_interfaces}

    def chunks(self, hidden_states, weight, bias, target_ids, *, gradients: frozenset[str] = frozenset()):
        """(loss, grad_hidden, grad_weight, grad_bias) for a unit loss gradient; each gradient
        is computed where ``gradients`` names its input, else None."""
        params = self.params
        rows, vocab = hidden_states.shape[0], weight.shape[0]
        wide = compute_dtype(hidden_states.dtype)
        keep = target_ids != params["ignore_index"]
        count = keep.sum()
        total = torch.zeros((), dtype=wide, device=hidden_states.device)
        grad_hidden = torch.empty_like(hidden_states) if "hidden_states" in gradients else None
        grad_weight = torch.zeros_like(weight) if "weight" in gradients else None
        grad_bias = torch.zeros(vocab, dtype=wide, device=hidden_states.device) if "bias" in gradients else None
        # A unit gradient of the loss, per row: 1 for 'sum', 1 / count for 'mean' (0 / 0 rows:
        # every row is ignored and gets 0 below).
        unit = torch.ones((), dtype=wide, device=hidden_states.device)
        if params["reduction"] == "mean":
            unit = unit / count
        step = chunk_rows(rows, hidden_states.shape[1], vocab)
        for start in range(0, rows, step):
            part = slice(start, min(rows, start + step))
            total = total + self.chunk(hidden_states, weight, bias, target_ids, part, unit, grad_hidden, grad_weight, grad_bias)
        loss = total if params["reduction"] == "sum" else total / count
        check_targets(type(self).__name__, target_ids, vocab, params["ignore_index"], loss)
        return loss, grad_hidden, grad_weight, None if grad_bias is None else grad_bias.to(hidden_states.dtype)

    def chunk(self, hidden_states, weight, bias, target_ids, part, unit, grad_hidden, grad_weight, grad_bias):
        """The summed loss of the rows ``part``; adds their share into each gradient given. A
        method of its own so that the chunk's logits are freed when it returns, before the next
        chunk's exist: a loop body would hold them until it rebinds the name, two chunks at once
        (H100, a 1.2B Llama's training step: two chunks' logits, 2 x 125 MiB, were alive at the
        step's peak of memory)."""
        wide = unit.dtype
        logits = F.linear(hidden_states[part], weight, bias)
        chunk_targets = target_ids[part]
        losses, lse = self.rows(logits, chunk_targets)
        if grad_hidden is None and grad_weight is None and grad_bias is None:
            return losses.sum()
        softmax_scale, target_scale = self.coefficients(unit, None, self.kept(chunk_targets), lse.to(wide))
        dlogits = self.gradient(logits, chunk_targets, lse.to(wide), softmax_scale, target_scale, logits)
        if grad_hidden is not None:
            torch.matmul(dlogits, weight, out=grad_hidden[part])
        if grad_weight is not None:
            grad_weight.addmm_(dlogits.t(), hidden_states[part])
        if grad_bias is not None:
            grad_bias += dlogits.sum(0, dtype=wide)
        return losses.sum()


class LinearCrossEntropyFwdOp(_LinearLossOp):
    """Cross-entropy of ``hidden_states @ weight.T (+ bias)`` without the whole logits:
    ``op(hidden_states, weight, bias=None, target_ids) -> loss``."""

    def forward(self, hidden_states, weight, bias, target_ids):
        loss, *_ = self.chunks(hidden_states, weight, bias, target_ids)
        return loss.to(hidden_states.dtype)

    def forward_saving(self, hidden_states, weight, bias, target_ids, *, wanted):
        loss, *gradients = self.chunks(hidden_states, weight, bias, target_ids, gradients=wanted)
        return loss.to(hidden_states.dtype), tuple(gradients)


class LinearCrossEntropyBwdOp(_LinearLossOp):
    """Gradients of ``LinearCrossEntropyFwdOp``:
    ``op(dloss, hidden_states, weight, bias, target_ids, grad_hidden, grad_weight, grad_bias) -> (dhidden, dweight, dbias)``,
    the forward's unit gradients ``grad_*`` scaled by ``dloss`` in place and returned (None for
    each not given: its input got no gradient). A scale is torch's elementwise multiply on every
    device: the op calls no kernel interface."""

    kernel_interfaces = ()

    def forward(self, dloss, hidden_states, weight, bias, target_ids, grad_hidden, grad_weight, grad_bias):
        # dloss has the gradients' dtype. A float32 copy of it gave the same products (a 0-dim
        # factor does not widen an in-place multiply; torch casts it to the tensor's dtype) but
        # took torch's casting path, which is not vectorised: H100, a 1.2B Llama's step, 1.17 ms
        # for the three gradients where their memory traffic is ~0.35 ms.
        for grad in (grad_hidden, grad_weight, grad_bias):
            if grad is not None:
                grad.mul_(dloss)
        return grad_hidden, grad_weight, grad_bias
