"""``torch.nn.Module`` drop-ins built on TileOPs ops, one module of this package per family:

* ``norm``: ``RMSNorm``, ``LayerNorm`` (the parameters and ``state_dict`` keys of
  ``torch.nn.RMSNorm`` / ``torch.nn.LayerNorm``, so a checkpoint loads into either),
  ``FusedAddRMSNorm``, ``FusedAddLayerNorm``;
* ``activation``: ``SwiGLU``, ``GeGLU`` (the gated activations of LLM MLPs), ``GatedMLP``
  (the whole MLP, with transformers' ``LlamaMLP`` ``state_dict`` keys) and ``PackedGatedMLP``
  (its gate and up projections fused, with ``Phi3MLP``'s keys);
* ``rope``: ``RotaryEmbedding``;
* ``attention``: ``Attention``;
* ``loss``: ``CrossEntropyLoss`` (``torch.nn.CrossEntropyLoss``'s options, plus z-loss and
  soft-capping) and ``LinearCrossEntropyLoss`` (the lm-head and the loss fused).

Every constructor takes ``target=`` (the target its op binds, as for any op). The modules are
differentiable, ``torch.compile``-able and copy and pickle like any module. A parameter whose
dtype differs from the input's (float32 parameters beside bfloat16 activations) is cast to the
input's dtype for the call, differentiably: the result has the input's dtype, as under
``torch.autocast``.
"""

from __future__ import annotations

from tileops.nn.activation import GatedMLP, GeGLU, PackedGatedMLP, SwiGLU
from tileops.nn.attention import Attention
from tileops.nn.loss import CrossEntropyLoss, LinearCrossEntropyLoss
from tileops.nn.norm import FusedAddLayerNorm, FusedAddRMSNorm, LayerNorm, RMSNorm
from tileops.nn.rope import RotaryEmbedding

__all__ = [
    "Attention",
    "CrossEntropyLoss",
    "FusedAddLayerNorm",
    "FusedAddRMSNorm",
    "GatedMLP",
    "GeGLU",
    "LayerNorm",
    "LinearCrossEntropyLoss",
    "PackedGatedMLP",
    "RMSNorm",
    "RotaryEmbedding",
    "SwiGLU",
]

# The classes are named where users import them (reports, reprs and pickles say tileops.nn.X).
for _cls in (Attention, CrossEntropyLoss, FusedAddLayerNorm, FusedAddRMSNorm, GatedMLP, GeGLU, LayerNorm, LinearCrossEntropyLoss,
             PackedGatedMLP, RMSNorm, RotaryEmbedding, SwiGLU):
    _cls.__module__ = __name__
del _cls
