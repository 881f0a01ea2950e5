"""The MLP modules of ``tileops.nn``: the gated activations ``SwiGLU`` and ``GeGLU``, and
``GatedMLP``, the whole gated MLP of Llama-style models.

``SwiGLU()(gate, up)`` is ``silu(gate) * up`` and ``GeGLU(approximate)(gate, up)`` is
``gelu(gate, approximate) * up`` (``SwiGLUFwdOp``, ``GeGLUFwdOp``). Built with ``d=``, they also
take one tensor holding ``[gate | up]`` along its last dimension, 2 * d wide (a fused gate-up
projection's output), and return d wide (``PackedSwiGLUFwdOp``, ``PackedGeGLUFwdOp``).

``PackedGatedMLP`` is the same MLP with the gate and up projections fused into one
``gate_up_proj`` (transformers' ``Phi3MLP``): ``down_proj(act(gate) * up)`` of the halves of
``gate_up_proj(x)``, the gated product on the packed op, which reads them where they are and
whose backward writes the gradient of the fused projection's output over it.

``GatedMLP(hidden_size, intermediate_size, activation)`` computes ``down_proj(act(gate_proj(x)) *
up_proj(x))`` with three ``torch.nn.Linear`` children under transformers' ``LlamaMLP`` names, so a
Llama, Mistral, Qwen or Gemma checkpoint's MLP weights load into it (``gate_proj.weight``,
``up_proj.weight``, ``down_proj.weight``, and their biases where ``bias=True``). Its projections'
outputs are its own temporaries, read by the activation alone, so its activation is built with
``consume_inputs=True``: the backward writes the two gradients over them (as Liger-Kernel's
SwiGLU does) instead of allocating two more tensors of the intermediate size.
"""

from __future__ import annotations

import torch

from tileops.ops import GeGLUFwdOp, PackedGeGLUFwdOp, PackedSwiGLUFwdOp, SwiGLUFwdOp

__all__ = ["GatedMLP", "GeGLU", "PackedGatedMLP", "SwiGLU"]


class _GLU(torch.nn.Module):
    """What the two gated activations share: the two-tensor call, and the packed one where the
    half width ``d`` was given (an op is built before ``torch.compile`` traces a call, so its
    width is fixed at construction)."""

    def __init__(self, options: dict, d: int | None, consume_inputs: bool, target: str | None) -> None:
        super().__init__()
        self.options, self.d, self.consume_inputs = options, d, consume_inputs
        self.op = self._two_tensor_op(**options, consume_inputs=consume_inputs, target=target)
        self.packed_op = None if d is None else self._packed_op(d, **options, consume_inputs=consume_inputs, target=target)

    def forward(self, gate: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
        if up is not None:
            return self.op(gate, up)
        if self.packed_op is None:
            raise TypeError(f"{type(self).__name__}: a packed [gate | up] input needs the half width d at construction "
                            f"({type(self).__name__}(d=...)); or call it with gate and up")
        return self.packed_op(gate)

    def extra_repr(self) -> str:
        shown = {**self.options, "d": self.d, "consume_inputs": self.consume_inputs or None}
        options = "".join(f"{name}={value!r}, " for name, value in shown.items() if value is not None)
        return f"{options}target={self.op.requested_target}"


class SwiGLU(_GLU):
    """``silu(gate) * up``: ``SwiGLU(*, d=None, consume_inputs=False, target=None)``;
    ``forward(gate, up)``, or ``forward(packed)`` for ``[gate | up]`` along the last dimension,
    2 * d wide. ``consume_inputs=True``: the backward writes the gradients over gate and up (or
    [dgate | dup] over the packed input) where they are temporaries of the graph
    (``SwiGLUFwdOp``'s and ``PackedSwiGLUFwdOp``'s param); for inputs nothing else reads, as an
    MLP's projections."""

    _two_tensor_op = SwiGLUFwdOp
    _packed_op = PackedSwiGLUFwdOp

    def __init__(self, *, d: int | None = None, consume_inputs: bool = False, target: str | None = None) -> None:
        super().__init__({}, d, consume_inputs, target)


class GeGLU(_GLU):
    """``gelu(gate, approximate) * up``: ``GeGLU(approximate="none", *, d=None,
    consume_inputs=False, target=None)``, ``approximate`` as ``torch.nn.functional.gelu``'s
    ('none' or 'tanh'); ``forward(gate, up)``, or ``forward(packed)`` for ``[gate | up]`` along
    the last dimension, 2 * d wide; ``consume_inputs`` as ``SwiGLU``'s."""

    _two_tensor_op = GeGLUFwdOp
    _packed_op = PackedGeGLUFwdOp

    def __init__(self, approximate: str = "none", *, d: int | None = None, consume_inputs: bool = False,
                 target: str | None = None) -> None:
        super().__init__({"approximate": approximate}, d, consume_inputs, target)


#: GatedMLP's activation names, and the gated module each is (its inputs the MLP's own
#: projections, which the backward may overwrite; ``d``: the packed form's half width).
ACTIVATIONS = {
    "silu": lambda target, d=None: SwiGLU(d=d, consume_inputs=True, target=target),
    "gelu": lambda target, d=None: GeGLU("none", d=d, consume_inputs=True, target=target),
    "gelu_tanh": lambda target, d=None: GeGLU("tanh", d=d, consume_inputs=True, target=target),
}


class _GatedMLPBase(torch.nn.Module):
    """What the two gated MLPs share: their sizes and activation name (checked), and their repr."""

    def __init__(self, hidden_size: int, intermediate_size: int, activation: str) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"{type(self).__name__}: activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.activation = activation

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, {self.intermediate_size}, activation={self.activation!r}"


class GatedMLP(_GatedMLPBase):
    """``down_proj(act(gate_proj(x)) * up_proj(x))``, the MLP of Llama-style models, with the
    gated product on a TileOPs op: ``GatedMLP(hidden_size, intermediate_size, activation="silu",
    bias=False, device=None, dtype=None, *, target=None)``. ``activation`` is ``"silu"``
    (SwiGLU: Llama, Mistral, Qwen), ``"gelu"`` or ``"gelu_tanh"`` (GeGLU: Gemma's
    ``gelu_pytorch_tanh``). The projections are ``torch.nn.Linear`` (torch's GEMMs); the
    ``state_dict`` is transformers' ``LlamaMLP``'s."""

    def __init__(self, hidden_size: int, intermediate_size: int, activation: str = "silu", bias: bool = False,
                 device=None, dtype=None, *, target: str | None = None) -> None:
        super().__init__(hidden_size, intermediate_size, activation)
        factory = {"bias": bias, "device": device, "dtype": dtype}
        self.gate_proj = torch.nn.Linear(hidden_size, intermediate_size, **factory)
        self.up_proj = torch.nn.Linear(hidden_size, intermediate_size, **factory)
        self.down_proj = torch.nn.Linear(intermediate_size, hidden_size, **factory)
        self.act = ACTIVATIONS[activation](target)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x), self.up_proj(x)))


class PackedGatedMLP(_GatedMLPBase):
    """``down_proj(act(gate) * up)`` where ``[gate | up] = gate_up_proj(x)``: the gated MLP with
    its gate and up projections fused into one GEMM, the gated product on ``PackedSwiGLUFwdOp``
    or ``PackedGeGLUFwdOp``: ``PackedGatedMLP(hidden_size, intermediate_size, activation="silu",
    bias=False, device=None, dtype=None, *, target=None)``, activations as ``GatedMLP``'s. The
    ``state_dict`` is transformers' ``Phi3MLP``'s (``gate_up_proj.weight``, 2 * intermediate_size
    rows, the gate's first; ``down_proj.weight``)."""

    def __init__(self, hidden_size: int, intermediate_size: int, activation: str = "silu", bias: bool = False,
                 device=None, dtype=None, *, target: str | None = None) -> None:
        super().__init__(hidden_size, intermediate_size, activation)
        factory = {"bias": bias, "device": device, "dtype": dtype}
        self.gate_up_proj = torch.nn.Linear(hidden_size, 2 * intermediate_size, **factory)
        self.down_proj = torch.nn.Linear(intermediate_size, hidden_size, **factory)
        self.act = ACTIVATIONS[activation](target, intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))
