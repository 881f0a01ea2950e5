"""The rope family's ops: ``RotaryEmbeddingFwdOp`` (q and k rotated in one call), its backward
op ``RotaryEmbeddingBwdOp``, and ``RotaryEmbeddingInplaceFwdOp`` (the same rotation written into
q and k, which reach its implementation as the caller passed them; not differentiable).

Each op builds the call spec its interface takes, runs the implementation selection picks, and
hands it q and k with their token dimensions flattened, (T, heads, D), and position_ids as (T,):
views, since the call path has made every read input contiguous (the in-place op, and an
implementation that takes any shape, get q and k as the caller passed them). The forward op
is differentiable: it saves nothing (``saves: []``), and core's autograd wiring calls the
backward op with the incoming gradients and the forward's cos, sin and position_ids.
"""

from __future__ import annotations

from importlib.resources import files

import torch

from tileops.core import Op, OpArgumentError

from ..vector_access import vector_ready
from .cpu import IMPLEMENTATIONS
from .interfaces import RotaryEmbeddingBwdInterface, RotaryEmbeddingFwdInterface, RotaryEmbeddingInplaceInterface


def _tokens(x: torch.Tensor, tokens: int) -> torch.Tensor:
    """``x`` (..., heads, D) as the (T, heads, D) a kernel takes: itself when already 3-D. The
    token count is given, since it cannot be inferred from an x without heads."""
    return x if x.dim() == 3 else x.view(tokens, x.shape[-2], x.shape[-1])


def _deliver(result, like: torch.Tensor):
    """A kernel's (T, heads, D) ``result`` in the shape of ``like``. A result that cannot take
    that shape (an implementation breaking its contract) is returned as it is, for the op's
    result check to report, as it reports one of another dtype or device."""
    try:
        return result.view_as(like)  # a third of the cost of view(like.shape)
    except (AttributeError, TypeError, RuntimeError):  # not a tensor, or not like's size
        return result


def refuse_positions_outside(op_name: str, position_ids: torch.Tensor, positions: int) -> None:
    """Raise an error naming the first of ``position_ids`` outside [0, positions), if one is.
    Called where an implementation raised IndexError (the CPU's, for such a position): a good
    call pays for no pass over the positions."""
    bad = (position_ids < 0) | (position_ids >= positions)
    if not bool(bad.any()):
        return
    at = tuple(int(i) for i in bad.nonzero()[0])
    raise OpArgumentError(
        f"{op_name}: argument 'position_ids' holds {int(position_ids[at])} at {at if len(at) > 1 else at[0]}; "
        f"expected positions in [0, {positions}) (the rows of cos and sin)"
    )


class _RopeOp(Op):
    manifest_file = files("tileops.ops") / "manifest" / "rope.yaml"
    # The TileLang kernels, key -> class per interface, imported when an op is first built.
    kernel_tables = ("tileops.kernels.cuda.rope:KERNELS",)

    def __init__(self, rotary_dim: int | None = None, style: str = "neox", *, target: str | None = None) -> None:
        super().__init__(rotary_dim=rotary_dim, style=style, target=target)

    def rotated_width(self, head_dim: int) -> int:
        """How many columns of a head of ``head_dim`` are rotated: rotary_dim, or all of them."""
        rotary_dim = self.params["rotary_dim"]
        return head_dim if rotary_dim is None else rotary_dim

    def call_spec(self, interface, device, dtype, cos_dtype, heads_q, heads_k, head_dim, aligned):
        """The call spec of ``kernel_for(interface, device, dtype, cos_dtype, heads_q, heads_k,
        head_dim, aligned)``: the forwards pass only what varies between calls; the rotated
        width and the style are the instance's."""
        return interface.call_spec(
            device, dtype, cos_dtype, heads_q, heads_k, head_dim, self.rotated_width(head_dim), self.params["style"], aligned
        )

    def call_specs(self, device, inputs):
        """The call spec a call with ``inputs`` (descriptions) gets, built as ``forward`` builds it."""
        (interface,) = self.kernel_interfaces
        first, second, cos, sin = (inputs[t.name] for t in self.manifest_entry().inputs[:4])
        spec = self.call_spec(
            interface, device, first.dtype, cos.dtype, first.shape[-2], second.shape[-2], first.shape[-1],
            vector_ready(device, 0, first.dtype, first, second, cos, sin),
        )
        return {interface: spec}

    def _rotate(self, interface, x, y, cos, sin, position_ids):
        device = x.device
        kernel = self.kernel_for(
            interface, device, x.dtype, cos.dtype, x.shape[-2], y.shape[-2], x.shape[-1], vector_ready(device, 0, x.dtype, x, y, cos, sin)
        )
        try:
            if kernel.takes_any_shape:
                return kernel.forward(x, y, cos, sin, position_ids)
            positions = position_ids.view(-1)
            tokens = positions.shape[0]
            result = kernel.forward(_tokens(x, tokens), _tokens(y, tokens), cos, sin, positions)
        except IndexError:
            refuse_positions_outside(type(self).__name__, position_ids, cos.shape[0])
            raise
        if type(result) is not tuple or len(result) != 2:
            return result
        return _deliver(result[0], x), _deliver(result[1], y)


class RotaryEmbeddingFwdOp(_RopeOp):
    """Rotary position embedding of q and k in one call:
    ``op(q, k, cos, sin, position_ids) -> (q_rot, k_rot)``, new tensors."""

    kernel_interfaces = (RotaryEmbeddingFwdInterface,)
    in_tree_kernels = {RotaryEmbeddingFwdInterface: IMPLEMENTATIONS[RotaryEmbeddingFwdInterface]}

    def forward(self, q, k, cos, sin, position_ids):
        return self._rotate(RotaryEmbeddingFwdInterface, q, k, cos, sin, position_ids)

    def forward_saving(self, q, k, cos, sin, position_ids):
        # Nothing to save: the backward reads the forward's cos, sin and position_ids.
        return self.forward(q, k, cos, sin, position_ids), ()


class RotaryEmbeddingBwdOp(_RopeOp):
    """Gradients of ``RotaryEmbeddingFwdOp``:
    ``op(dq_rot, dk_rot, cos, sin, position_ids) -> (dq, dk)``, the rotation by -theta."""

    kernel_interfaces = (RotaryEmbeddingBwdInterface,)
    in_tree_kernels = {RotaryEmbeddingBwdInterface: IMPLEMENTATIONS[RotaryEmbeddingBwdInterface]}

    def forward(self, dq_rot, dk_rot, cos, sin, position_ids):
        return self._rotate(RotaryEmbeddingBwdInterface, dq_rot, dk_rot, cos, sin, position_ids)


class RotaryEmbeddingInplaceFwdOp(_RopeOp):
    """Rotary position embedding of q and k where they are: ``op(q, k, cos, sin, position_ids)
    -> (q, k)``. q and k may be slices of a fused qkv tensor. Not differentiable (a training step
    uses ``RotaryEmbeddingFwdOp``). Under ``torch.compile`` its custom op declares q and k written
    and the traced call returns the caller's tensors."""

    kernel_interfaces = (RotaryEmbeddingInplaceInterface,)
    in_tree_kernels = {RotaryEmbeddingInplaceInterface: IMPLEMENTATIONS[RotaryEmbeddingInplaceInterface]}

    def forward(self, q, k, cos, sin, position_ids):
        device = q.device
        kernel = self.kernel_for(
            RotaryEmbeddingInplaceInterface, device, q.dtype, cos.dtype, q.shape[-2], k.shape[-2], q.shape[-1],
            vector_ready(device, 0, q.dtype, q, k, cos, sin),
        )
        try:
            kernel.forward(q, k, cos, sin, position_ids)
        except IndexError:
            refuse_positions_outside(type(self).__name__, position_ids, cos.shape[0])
            raise
        return q, k
