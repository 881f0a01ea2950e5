"""TileLang implementations of the rope family's kernel interfaces, and their key table.

Two variants per interface, each one program (``programs``) rotating q and k in one launch:
``tilelang`` moves 16-byte vectors (the head size and the pairs fill whole vectors, every
pointer is 16-byte aligned: every model's head of 64, 128 or 256 columns), ``tilelang_general``
moves single columns and serves every even rotated width, head size and alignment. The backward
kernels are the forward's with ``inverse`` (sin negated and read at the partner column).
``KERNELS`` (interface -> key -> class) is the table the ops name; where both serve a call the
vectorised one wins (``preferred_over``), and the general one is ``general``. The in-place op's
``tilelang`` rotates through the forward kernel into new tensors and copies them back: twice the
memory traffic of a kernel that writes in place. The program has an in-place build (``programs``,
compiled in the compile tier), which waits on the shared runtime: its launcher allocates at least
one output.

The launch rule follows from the shape: a token's units (``programs``) are cut into blocks of
``launch_threads(units)`` threads, the multiple of 32 up to 256 that leaves the fewest threads
idle in a token's last block (the largest such), so that no warp is launched for nothing and
decode calls of a few tokens still spread over several blocks per token. Importing this module
does not import tilelang; building a kernel does.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from tileops.core import Kernel
from tileops.ops.rope import (
    RopeCall,
    RotaryEmbeddingBwdInterface,
    RotaryEmbeddingFwdInterface,
    RotaryEmbeddingInplaceInterface,
)

from ..kernel import BuildPlan, Output, TileLangKernel
from ..row_layout import vector_width
from . import programs

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_WARP = 32
_MAX_THREADS = 256


def launch_threads(units: int) -> int:
    """Threads per block for a token of ``units`` units: the multiple of 32 up to 256 whose
    blocks leave the fewest threads idle in the token's last block, the largest of those."""
    candidates = range(_WARP, _MAX_THREADS + 1, _WARP)
    return min(candidates, key=lambda threads: (-units % threads, -threads))


class _TileLangRope(TileLangKernel):
    """One compiled rope program for a (dtype, cache dtype, heads, head size, rotated width,
    style, device)."""

    family = "rope"
    kind = "rope"
    outputs = (Output.like_argument(0), Output.like_argument(1))
    ranks_built_eagerly = (3,)  # the interface's q and k are always (T, heads, D)
    #: True in the backward kernels: the transposed map.
    inverse: ClassVar[bool] = False
    #: True in the vectorised variant.
    vectorised: ClassVar[bool] = True

    def __init__(self, call: RopeCall) -> None:
        super().__init__(call.device, call)

    @classmethod
    def refusal(cls, call: RopeCall) -> str | None:
        if call.dtype not in _DTYPES or call.cos_dtype not in _DTYPES:
            return f"takes float16, bfloat16 and float32 tensors and caches, not {call.dtype} with {call.cos_dtype} caches"
        if cls.vectorised:
            if not call.aligned:
                return "needs 16-byte aligned tensors (the general variant serves the others)"
            vec = vector_width(call.dtype)
            pairs = call.rotary_dim // 2 if call.style == "neox" else call.rotary_dim
            if call.head_dim % vec or pairs % vec:
                return (
                    f"needs the head size ({call.head_dim}) and the {call.style} pairs of the rotated width "
                    f"({call.rotary_dim}) in whole 16-byte vectors of {vec} (the general variant serves the others)"
                )
        return None

    @classmethod
    def entry_for(cls, call: RopeCall):
        return call, lambda: cls(call)

    def identity(self) -> tuple:
        call = self.params
        return (
            self.vectorised, call.dtype, call.cos_dtype, call.heads_q, call.heads_k, call.head_dim,
            call.rotary_dim, call.style, self.inverse,
        )

    def _widths(self) -> tuple[int, int]:
        """(vec, pass_vec) of this variant."""
        if self.vectorised:
            vec = vector_width(self.params.dtype)
            return vec, vec
        return (1 if self.params.style == "neox" else 2), 1

    def default_config(self) -> dict[str, Any]:
        call = self.params
        vec, pass_vec = self._widths()
        rotating, passing = programs.units_per_head(call.head_dim, call.rotary_dim, call.style, vec, pass_vec, False)
        units = (call.heads_q + call.heads_k) * (rotating + passing)
        return {"vec": vec, "pass_vec": pass_vec, "threads": launch_threads(units)}

    def tuning_candidates(self) -> list[dict[str, Any]]:
        default = self.default_config()
        others = [{**default, "threads": threads} for threads in (64, 128, 256) if threads != default["threads"]]
        return [default, *others]

    def build_plan(self, config: dict[str, Any]) -> BuildPlan:
        return BuildPlan({"main": config}, shown=dict(config))

    def compile(self, config: dict[str, Any], rank: int) -> Any:
        # q and k are (T, heads, D) by the interface's contract: one program serves them.
        call = self.params
        return programs.compile_program(
            call.dtype, call.cos_dtype, call.heads_q, call.heads_k, call.head_dim, call.rotary_dim, call.style,
            self.inverse, self.tilelang_target, **config,
        )


class TileLangRope(_TileLangRope, RotaryEmbeddingFwdInterface):
    """The forward, 16-byte vectors."""


class TileLangRopeGeneral(_TileLangRope, RotaryEmbeddingFwdInterface):
    """The forward, single columns: any even rotated width, head size and alignment."""

    vectorised = False
    general = True


class TileLangRopeBwd(_TileLangRope, RotaryEmbeddingBwdInterface):
    """The backward (rotation by -theta), 16-byte vectors."""

    inverse = True


class TileLangRopeBwdGeneral(_TileLangRope, RotaryEmbeddingBwdInterface):
    """The backward, single columns."""

    inverse = True
    vectorised = False
    general = True


class TileLangRopeInplace(Kernel, RotaryEmbeddingInplaceInterface):
    """The in-place rotation by the forward kernel (the vectorised one where it serves the call,
    else the general one): q and k rotated into new tensors, then copied into q and k, whatever
    their strides."""

    @classmethod
    def refusal(cls, call: RopeCall) -> str | None:
        return TileLangRopeGeneral.refusal(call)

    @classmethod
    def entry_for(cls, call: RopeCall):
        return call, lambda: cls(call)

    def __init__(self, call: RopeCall) -> None:
        super().__init__()
        variant = TileLangRope if TileLangRope.refusal(call) is None else TileLangRopeGeneral
        self.rotate = variant(call)
        self.config = self.rotate.config

    def request_tune(self) -> None:
        self.rotate.request_tune()

    def forward(self, q, k, cos, sin, position_ids):
        positions = position_ids.reshape(-1)
        tokens = positions.shape[0]
        # The program reads packed (T, heads, D) rows: a strided q or k (a slice of a fused qkv
        # tensor) is packed first.
        q_rot, k_rot = self.rotate.forward(
            q.reshape(tokens, *q.shape[-2:]).contiguous(), k.reshape(tokens, *k.shape[-2:]).contiguous(),
            cos, sin, positions,
        )
        q.copy_(q_rot.view_as(q))
        k.copy_(k_rot.view_as(k))


TileLangRope.preferred_over = frozenset({"tilelang_general"})
TileLangRopeBwd.preferred_over = frozenset({"tilelang_general"})

KERNELS = {
    RotaryEmbeddingFwdInterface: {"tilelang": TileLangRope, "tilelang_general": TileLangRopeGeneral},
    RotaryEmbeddingBwdInterface: {"tilelang": TileLangRopeBwd, "tilelang_general": TileLangRopeBwdGeneral},
    RotaryEmbeddingInplaceInterface: {"tilelang": TileLangRopeInplace},
}
