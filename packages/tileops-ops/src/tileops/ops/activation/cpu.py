"""Plain-torch implementations of the activation interfaces, forward and backward.

They compute in float32 (float64 for float64 tensors) and round once, like the manifest's
reference. The ``torch_cpu`` ones are ``general``: they serve every CPU call, and any narrower
implementation a backend adds beats them. The ``torch_float64`` ones serve float64 calls on
CUDA, which the TileLang kernels do not take (float64 is there for ``gradcheck``, not for
speed). They record no autograd history: the ops' autograd node calls the backward op.
"""

from __future__ import annotations

import torch

from tileops.core import Kernel

from ..compute_dtypes import COMPUTE_DTYPES, as_dtype, widened
from ..float64_on_cuda import float64_on_cuda
from .interfaces import (
    ActivationBwdInterface,
    ActivationCall,
    ActivationFwdInterface,
    GatedBwdInterface,
    GatedFwdInterface,
    GatedInplaceBwdInterface,
    PackedGatedBwdInterface,
    PackedGatedFwdInterface,
    PackedGatedInplaceBwdInterface,
)


#: Each activation as torch's own function, picked once per kernel rather than per call, and
#: without ``F.silu``'s Python checks: on a (4, 1024) CPU call these cost 0.5-0.7 us, about a
#: fifth of the op's overhead budget.
_ACTIVATIONS = {
    "silu": torch._C._nn.silu,
    "gelu": torch._C._nn.gelu,
    "gelu_tanh": lambda x: torch._C._nn.gelu(x, approximate="tanh"),
}


def activate_backward(dy: torch.Tensor, x: torch.Tensor, activation: str, *, into: torch.Tensor | None = None) -> torch.Tensor:
    """``dy * activation'(x)`` (both already in their compute dtype), written to ``into`` where
    given (``dy`` itself, when it is a temporary of the caller's)."""
    # torch's own kernels: one pass, where the formula took six.
    if activation == "silu":
        if into is None:
            return torch.ops.aten.silu_backward(dy, x)
        return torch.ops.aten.silu_backward.grad_input(dy, x, grad_input=into)
    approximate = "tanh" if activation == "gelu_tanh" else "none"
    if into is None:
        return torch.ops.aten.gelu_backward(dy, x, approximate=approximate)
    return torch.ops.aten.gelu_backward.grad_input(dy, x, approximate=approximate, grad_input=into)


class _TorchActivation(Kernel):
    devices = frozenset({"cpu"})
    general = True
    takes_any_shape = True  # elementwise, and chunk/cat on the last dimension: any rank

    def __init__(self, activation: str) -> None:
        super().__init__()
        self.activation = activation
        self.activate = _ACTIVATIONS[activation]  # of a tensor already in its compute dtype

    # The products are written over a temporary the kernel made (mul_, grad_input=): on the CPU
    # a fresh tensor per step costs its page faults, and the gated backward took 2.8 ms on
    # (2, 256, 1376) float32 with one per step, 1.9 ms this way.
    def gated(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """``act(gate) * up`` in gate's dtype, computed in float32 for 16-bit dtypes (up has
        gate's dtype: the signature checked it)."""
        if gate.dtype in COMPUTE_DTYPES:
            return self.activate(gate).mul_(up)
        return self.activate(gate.float()).mul_(up).to(gate.dtype)

    def gated_gradients(self, dy, gate, up):
        dy_w, gate_w = widened(dy), widened(gate)
        product = dy_w * up  # in the compute dtype: dy_w is float32 or float64
        dgate = activate_backward(product, gate_w, self.activation, into=product)
        dup = self.activate(gate_w).mul_(dy_w)
        return as_dtype(dgate, dy.dtype), as_dtype(dup, dy.dtype)

    @classmethod
    def entry_for(cls, call: ActivationCall):
        return call.activation, lambda: cls(call.activation)


class TorchCpuActivation(_TorchActivation, ActivationFwdInterface):
    def forward(self, x):
        return as_dtype(self.activate(widened(x)), x.dtype)


class TorchCpuActivationBwd(_TorchActivation, ActivationBwdInterface):
    def forward(self, dy, x):
        return as_dtype(activate_backward(widened(dy), widened(x), self.activation), dy.dtype)


class TorchCpuGated(_TorchActivation, GatedFwdInterface):
    def forward(self, gate, up):
        return self.gated(gate, up)


class TorchCpuGatedBwd(_TorchActivation, GatedBwdInterface):
    def forward(self, dy, gate, up):
        return self.gated_gradients(dy, gate, up)


class TorchCpuGatedInplaceBwd(_TorchActivation, GatedInplaceBwdInterface):
    # The gradients are computed as the out-of-place backward computes them, then copied over:
    # the same values to the bit, and the memory the in-place form saves is a GPU's concern.
    def forward(self, dy, gate, up):
        dgate, dup = self.gated_gradients(dy, gate, up)
        gate.copy_(dgate)
        up.copy_(dup)


class TorchCpuPackedGated(_TorchActivation, PackedGatedFwdInterface):
    def forward(self, x):
        return self.gated(*x.chunk(2, -1))


class TorchCpuPackedGatedBwd(_TorchActivation, PackedGatedBwdInterface):
    def forward(self, dy, x):
        gate, up = x.chunk(2, -1)
        return torch.cat(self.gated_gradients(dy, gate, up), -1)


class TorchCpuPackedGatedInplaceBwd(_TorchActivation, PackedGatedInplaceBwdInterface):
    # As the gated in-place form: computed out of place, then copied over x.
    def forward(self, dy, x):
        gate, up = x.chunk(2, -1)
        x.copy_(torch.cat(self.gated_gradients(dy, gate, up), -1))


#: key -> class per interface: the CPU implementations, and the float64 ones on CUDA.
IMPLEMENTATIONS = {
    interface: {
        "torch_cpu": cpu_class,
        "torch_float64": float64_on_cuda(cpu_class),
    }
    for interface, cpu_class in (
        (ActivationFwdInterface, TorchCpuActivation),
        (ActivationBwdInterface, TorchCpuActivationBwd),
        (GatedFwdInterface, TorchCpuGated),
        (GatedBwdInterface, TorchCpuGatedBwd),
        (GatedInplaceBwdInterface, TorchCpuGatedInplaceBwd),
        (PackedGatedFwdInterface, TorchCpuPackedGated),
        (PackedGatedBwdInterface, TorchCpuPackedGatedBwd),
        (PackedGatedInplaceBwdInterface, TorchCpuPackedGatedInplaceBwd),
    )
}
