"""The TileLang implementations of variable-length attention (``VarlenAttentionFwdInterface``,
``VarlenAttentionBwdInterface``), and their key table ``KERNELS``, which the varlen ops name.

``VarlenAttentionFwdKernel`` launches the forward program (``varlen_programs``);
``VarlenAttentionBwdKernel`` the delta/lse2 kernel, the main kernel and the dQ cast, with float32
workspaces allocated per call (delta and lse2 (H, T_pad), the dQ accumulator (H, T_pad, D)
zeroed; T_pad is T_q plus a tile). Each call first maps its tiles to their sequences on the
device (``tile_sequences``: a few tensor operations on the current stream, no host read), so a
call is captured in a CUDA graph and replays with any lengths of the same totals. Every program
is compiled when the kernel is built, so that no call compiles or loads a module. Both need
Hopper (wgmma, TMA) and take float16 and bfloat16 with head sizes 64, 128 and 256, like the
dense kernels (``policy``, whose launch rules they share); plain torch serves the rest.
Importing this module does not import tilelang; building a kernel does.
"""

from __future__ import annotations

import concurrent.futures

import torch

from tileops.core import Kernel
from tileops.ops.attention import VarlenAttentionBwdInterface, VarlenAttentionCall, VarlenAttentionFwdInterface

from ..compile import entry_function
from ..device import compile_target, current_device_index
from . import policy
from . import varlen_programs as programs


def tile_sequences(cu_seqlens: torch.Tensor, block: int, total: int) -> torch.Tensor:
    """The sequence of each of the ``total // block + B`` tiles of ``block`` packed rows, int32,
    computed on ``cu_seqlens``' device: sequence b owns the tiles from ``cu_seqlens[b] // block + b``
    (``varlen_programs`` says why that covers every length)."""
    batch = cu_seqlens.shape[0] - 1
    device = cu_seqlens.device
    firsts = torch.div(cu_seqlens, block, rounding_mode="floor") + torch.arange(batch + 1, device=device, dtype=torch.int32)
    tiles = torch.arange(total // block + batch, device=device, dtype=torch.int32)
    return (torch.searchsorted(firsts, tiles, right=True, out_int32=True) - 1).clamp_(0, batch - 1)


class _TileLangVarlenAttention(Kernel):
    supported_archs = frozenset({90})

    def __init__(self, call: VarlenAttentionCall) -> None:
        super().__init__()
        self.call = call
        self._device_index = call.device.index if call.device.index is not None else torch.cuda.current_device()
        self._target = compile_target(call.device)

    @classmethod
    def refusal(cls, call: VarlenAttentionCall) -> str | None:
        return policy.refusal(call.dtype, call.head_dim)

    @classmethod
    def entry_for(cls, call: VarlenAttentionCall):
        return call, lambda: cls(call)

    def _on_device(self, launch, *arguments):
        if current_device_index() == self._device_index:
            launch(*arguments)
        else:
            # TileLang launches in the current device's context: make the call's device current.
            with torch.cuda.device(self._device_index):
                launch(*arguments)


class VarlenAttentionFwdKernel(_TileLangVarlenAttention, VarlenAttentionFwdInterface):
    """Flash attention forward over a packed batch: (o, lse) for q, k, v and the offsets."""

    def __init__(self, call: VarlenAttentionCall) -> None:
        super().__init__(call)
        self.config = policy.forward_config(call.head_dim)
        self._main = entry_function(programs.compile_forward(call, self._target, **self.config))

    def forward(self, q, k, v, cu_seqlens_q, cu_seqlens_k):
        o = torch.empty_like(q)
        lse = torch.empty((q.shape[1], q.shape[0]), dtype=torch.float32, device=q.device)
        self._on_device(self._launch, q, k, v, cu_seqlens_q, cu_seqlens_k, o, lse)
        return o, lse

    def _launch(self, q, k, v, cu_seqlens_q, cu_seqlens_k, o, lse) -> None:
        tiles = tile_sequences(cu_seqlens_q, self.config["block_m"], q.shape[0])
        self._main(q, k, v, cu_seqlens_q, cu_seqlens_k, tiles, o, lse)


class VarlenAttentionBwdKernel(_TileLangVarlenAttention, VarlenAttentionBwdInterface):
    """Flash attention backward over a packed batch: (dq, dk, dv)."""

    def __init__(self, call: VarlenAttentionCall) -> None:
        super().__init__(call)
        self.config = policy.backward_config(call.head_dim)
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            main = pool.submit(programs.compile_bwd_main, call, self._target, **self.config)
            pre = pool.submit(programs.compile_bwd_pre, call, self._target, **policy.ROWS_KERNEL)
            post = pool.submit(programs.compile_bwd_post, call, self._target, **policy.ROWS_KERNEL)
            self._main, self._pre, self._post = (entry_function(f.result()) for f in (main, pre, post))
        # The workspaces hold a query tile of rows past T_q: the largest tile a kernel reads.
        self._pad = max(self.config["block_m"], policy.ROWS_KERNEL["block_m"])

    def forward(self, do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, dlse):
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        dlse = torch.zeros_like(lse) if dlse is None else dlse
        self._on_device(self._launch, do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, dlse, dq, dk, dv)
        return dq, dk, dv

    def _launch(self, do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, dlse, dq, dk, dv) -> None:
        heads_q, total_pad = q.shape[1], q.shape[0] + self._pad
        delta = torch.empty(heads_q, total_pad, dtype=torch.float32, device=q.device)
        lse2 = torch.empty_like(delta)
        dq_acc = torch.zeros(heads_q, total_pad, q.shape[2], dtype=torch.float32, device=q.device)
        tiles = tile_sequences(cu_seqlens_k, self.config["block_n"], k.shape[0])
        self._pre(do, o, lse, dlse, delta, lse2)
        self._main(do, q, k, v, cu_seqlens_q, cu_seqlens_k, tiles, delta, lse2, dq_acc, dk, dv)
        self._post(dq_acc, dq)


KERNELS = {
    VarlenAttentionFwdInterface: {"tilelang": VarlenAttentionFwdKernel},
    VarlenAttentionBwdInterface: {"tilelang": VarlenAttentionBwdKernel},
}
