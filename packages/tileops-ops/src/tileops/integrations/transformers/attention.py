"""Attention and the rotary embedding in transformers models, on TileOPs.

**Attention** joins transformers' attention-function registry as the implementation named
``"tileops"`` (``register()`` adds it to ``AttentionInterface``, and ``attention_mask`` to
``AttentionMaskInterface``: transformers' SDPA mask builder, which builds no mask for a causal
call without padding whose queries are all the keys' tokens or one, under ``torch.compile`` too);
``apply()`` sets the model's ``_attn_implementation`` to it and hands each attention module the
``AttentionFwdOp`` instances it calls (ops are built outside ``torch.compile``'s trace). The
function takes what transformers' ``sdpa`` function takes and computes, on the op, what it
computes where no mask tensor is given: the mask builder gives none for a causal call without
padding (training, a prefill, a decode step of one token per sequence over a ``DynamicCache``).
The op's causal mask is aligned to the bottom right, so a query's row sees the keys of the tokens
before it in the cache. A decode step (one query per sequence over keys the cache holds
contiguously, heads first) runs on ``DecodeAttentionFwdOp`` over the cache as it is
(``cache_layout="bhsd"``), every sequence's length the keys' count: its kernels read a kv head's
keys once for the query heads of its group, where ``AttentionFwdOp`` reads them for each. A decode
step's boolean mask (padding, a static cache's unfilled rows: its one row is what the query sees)
becomes the decode op's key mask. Where the call cannot be expressed by the op, ``attention()``
calls transformers' ``sdpa`` function instead, for that call, and the result is the same as
unpatched:

* a mask tensor, but for a decode step's (padding in a batch, packed sequences; an additive or
  per-head mask): the ops take no arbitrary mask;
* attention dropout in training, ``softcap``, ``output_attentions``, a position bias, or an
  ``is_causal`` that differs from the module's;
* on a GPU, a call no TileOPs kernel takes, which the op would serve with its plain-torch
  reference (``AttentionOps.kernels_serve``);
* a module without the ops of the call's window (a model loaded with
  ``attn_implementation="tileops"`` and not ``apply()``-ed, under ``torch.compile``; eagerly the
  op is built at the first call).

**The rotary embedding**: the rotation of q and k (transformers' module-level
``apply_rotary_pos_emb``, which each attention forward calls) runs on ``RotaryEmbeddingFwdOp``.
The attention module's class becomes a subclass whose ``forward`` is the class's own forward
code with that one name bound to TileOPs' rotation (only in this model: other models of the
class are untouched). Which rotation, if any, is decided by running the model's function and the
op's two styles on random inputs (``rotation_style``): Llama's rotates halves, Cohere's pairs,
and a function of that name with other parameters or another formula keeps its own. The rotary
module that computes the cos and sin tables is left.
"""

from __future__ import annotations

import functools
import inspect
import types
import weakref
from collections.abc import Callable
from typing import Any

import torch

from tileops.core.tensor_description import TensorDescription
from tileops.ops import AttentionFwdOp, DecodeAttentionFwdOp, RotaryEmbeddingFwdOp

IMPLEMENTATION = "tileops"
#: The implementation TileOPs' replaces: its masks are the ones the function reads, and the calls
#: its ops do not take go to it.
STANDS_IN_FOR = "sdpa"

#: transformers' sdpa attention function, set by register(): where the op cannot serve a call.
_sdpa: Callable[..., Any] | None = None


def register() -> None:
    """Add ``"tileops"`` to transformers' attention functions and mask builders (idempotent)."""
    global _sdpa
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    if _sdpa is None:
        _sdpa = AttentionInterface._global_mapping[STANDS_IN_FOR]
    AttentionInterface.register(IMPLEMENTATION, attention)
    AttentionMaskInterface.register(IMPLEMENTATION, attention_mask)


def attention_mask(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    """transformers' SDPA mask builder, which builds no mask (None) for a causal call without
    padding whose queries are all the keys' tokens or one (a training step, a prefill, a decode
    step over a cache that holds only its sequence's keys), as that builder does eagerly: the op's
    own causal mask is that call's. Under ``torch.compile`` on torch before 2.14 transformers'
    builder cannot tell such a call from an exported one and builds the mask, which would send
    every compiled call to sdpa (a 1.2B Llama's compiled training step ran cuDNN's attention
    through SDPA, 31 ms of its GPU time, where TileOPs' took 16 ms). Arguments are keywords, as
    transformers passes them (earlier releases pass ``cache_position``, as long as the queries, for ``q_length``)."""
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    if not args and kwargs.get("allow_is_causal_skip", True) and kwargs.get("attention_mask") is None:
        positions = kwargs.get("cache_position")
        q_length = kwargs.get("q_length", None if positions is None else positions.shape[0])
        # (A release that names them otherwise gets transformers' builder, as unpatched.)
        if (q_length is not None and kwargs.get("mask_function") is causal_mask_function
                and kwargs.get("local_size") is None and (q_length == 1 or q_length == kwargs.get("kv_length"))):
            return None
    return sdpa_mask(*args, **kwargs)


class AttentionOps:
    """The ``AttentionFwdOp`` instances one attention module calls, by (qkv_layout, window), and
    the ``DecodeAttentionFwdOp`` of its decode steps (``decode``), built for its causality and
    scale and bound to one target. Shared by the modules that need the same ops."""

    def __init__(self, causal: bool, scale: float | None, target: str | None) -> None:
        self.causal, self.scale, self.target = causal, scale, target
        self.ops: dict[tuple[str, int | None], AttentionFwdOp] = {}
        self.decode = DecodeAttentionFwdOp(scale, causal, cache_layout="bhsd", target=target)
        self._kernels_serve: dict[tuple, bool] = {}

    def kernels_serve(self, op: AttentionFwdOp | DecodeAttentionFwdOp, inputs: dict[str, torch.Tensor]) -> bool:
        """Whether ``op`` runs a kernel of its own on a call with ``inputs`` (a name -> tensor
        map), not only its plain-torch reference: on a GPU TileOPs holds no kernel for (a head
        size the kernels do not take, a GPU older than they need), the reference would be many
        times slower than transformers' sdpa, so those calls go to sdpa. On the CPU the
        reference is TileOPs' implementation. Decided once per op, device, dtype and head
        layout, outside traced code: ``decide_ahead`` decides for the GPUs present when the
        model is patched; a compiled call on none of them takes the op."""
        q = inputs["q"]
        if q.device.type == "cpu":
            return True
        # Heads and head size, which the kernels' refusals read (never the batch or lengths).
        if op is self.decode:
            heads = (q.shape[2], inputs["k_cache"].shape[1], q.shape[3])
        else:
            at = 2 if op.params["qkv_layout"] == "bshd" else 1
            heads = (q.shape[at], inputs["k"].shape[at], q.shape[3])
        key = (op, q.device, q.dtype, "key_mask" in inputs, heads)
        decided = self._kernels_serve.get(key)
        if decided is None:
            if torch.compiler.is_compiling():
                return True
            described = {name: TensorDescription(t.device, t.dtype, tuple(t.shape)) for name, t in inputs.items()}
            decided = self._kernels_serve[key] = op.served_beyond_general(q.device, described)
        return decided

    def decide_ahead(self, heads_q: int, heads_kv: int, head_dim: int) -> None:
        """Decide ``kernels_serve`` now for every op of these heads on every GPU present, in the
        16-bit dtypes and float32, so that a compiled model's calls (which cannot ask) find the
        answer: descriptions of a one-token call stand for every call of these heads."""
        for index in range(torch.cuda.device_count()):
            for dtype in (torch.bfloat16, torch.float16, torch.float32):
                for op, inputs in self._one_token_calls(torch.device("cuda", index), dtype, heads_q, heads_kv, head_dim):
                    self.kernels_serve(op, inputs)

    def _one_token_calls(self, device: torch.device, dtype: torch.dtype, heads_q: int, heads_kv: int, head_dim: int):
        """(op, inputs described) of a one-token call of each op: prefill ops in their layout,
        and a decode step with and without a key mask."""
        def described(*shape, of=dtype):
            return TensorDescription(device, of, shape)

        for op in self.ops.values():
            if op.params["qkv_layout"] == "bshd":
                q, k = described(1, 1, heads_q, head_dim), described(1, 1, heads_kv, head_dim)
            else:
                q, k = described(1, heads_q, 1, head_dim), described(1, heads_kv, 1, head_dim)
            yield op, {"q": q, "k": k, "v": k}
        cache = described(1, heads_kv, 1, head_dim)
        step = {"q": described(1, 1, heads_q, head_dim), "k_cache": cache, "v_cache": cache,
                "cache_seqlens": described(1, of=torch.int32)}
        yield self.decode, step
        yield self.decode, {**step, "key_mask": described(1, 1, of=torch.bool)}

    def build(self, window: int | None) -> None:
        for layout in ("bshd", "bhsd"):
            if (layout, window) not in self.ops:
                self.ops[layout, window] = AttentionFwdOp(causal=self.causal, window=window, scale=self.scale,
                                                          qkv_layout=layout, target=self.target)

    def get(self, layout: str, window: int | None) -> AttentionFwdOp | None:
        op = self.ops.get((layout, window))
        if op is None and not torch.compiler.is_compiling():
            self.build(window)
            op = self.ops[layout, window]
        return op


def _is_window(value: Any, *, none: bool = False) -> bool:
    """Whether ``value`` is a sliding window the ops take: a positive int (or None, where ``none``
    says that no window counts). Configs also hold 0 or -1 for layers without one (Qwen2-MoE's)."""
    if value is None:
        return none
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _window(sliding_window: int | None) -> int | None:
    """transformers' sliding window (a query sees the ``sliding_window`` keys up to its own) as
    the op's (the keys before the diagonal)."""
    return None if sliding_window is None else sliding_window - 1


def _key_mask(attention_mask: Any, batch: int, k_length: int) -> torch.Tensor | None:
    """The decode op's key mask, (B, S_k), of the boolean mask transformers gives one query
    (B or 1, 1, 1, S_k): for one query its one row is exactly the keys it sees (padding, a
    static cache's unfilled rows, a sliding window alike). None for a mask of another form
    (additive floats, one per head), which goes to sdpa."""
    if (not isinstance(attention_mask, torch.Tensor) or attention_mask.dtype != torch.bool or attention_mask.dim() != 4
            or attention_mask.shape[1:] != (1, 1, k_length) or attention_mask.shape[0] not in (1, batch)):
        return None
    return attention_mask[:, 0, 0].expand(batch, k_length)


def _lengths(key_mask: torch.Tensor | None, batch: int, k_length: int, device: torch.device) -> torch.Tensor:
    """The decode op's ``cache_seqlens``: each sequence's last shown key + 1 under a mask, the
    whole cache without one. The kernels load no position the mask hides, but they walk every
    tile before the length: with the cache's length a step at position 100 of a 4096-row static
    cache walked its 64 tiles of 64 positions, with this one 2. Computed on the device, so a
    captured graph replays it."""
    if key_mask is None:
        return torch.full((batch,), k_length, dtype=torch.int32, device=device)
    positions = torch.arange(1, k_length + 1, dtype=torch.int32, device=device)
    return torch.where(key_mask, positions, 0).amax(-1)


def _layout(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> str:
    """The op layout whose call copies the fewest elements. The op copies an input that is not
    contiguous in its layout; in ``bshd`` its output is the (B, S, H_q, D) tensor transformers
    wants, in ``bhsd`` that is a transposed copy. Where the inputs come as views of the
    projections' (B, S, H, D) outputs (no cache) both layouts of q agree; with a cache that
    concatenates keys and values (transformers' ``DynamicCache``, also in a training step that
    leaves ``use_cache`` on) k and v are contiguous (B, H_kv, S, D) and q is not. H100, a 1.2B
    Llama's training step (32/8 heads): choosing ``bhsd`` there copied q, o, dO and q again for
    the backward (3.6 of 141 ms of GPU time), and the transposed output copy held 0.5 GiB beside
    the op's saved o; ``bshd`` copies the 4x smaller k and v instead."""
    def copied(tensors) -> int:
        return sum(t.numel() for t in tensors if not t.is_contiguous())

    bshd = copied(t.transpose(1, 2) for t in (query, key, value))
    bhsd = copied((query, key, value)) + query.numel()
    return "bshd" if bshd <= bhsd else "bhsd"


def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
              is_causal: bool | None = None, sliding_window: int | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function interface, on ``AttentionFwdOp`` and (decode steps)
    ``DecodeAttentionFwdOp``: query (B, H_q, S_q, D), key and value (B, H_kv, S_k, D); returns
    ((B, S_q, H_q, D), None)."""
    causal = getattr(module, "is_causal", True)
    ops: AttentionOps | None = getattr(module, "tileops_attention", None)
    unsupported = (dropout > 0.0 or kwargs.get("softcap") is not None or not _is_window(sliding_window, none=True)
                   or kwargs.get("output_attentions", False) or kwargs.get("position_bias") is not None
                   or (is_causal is not None and is_causal != causal) or ops is None or ops.causal != causal
                   or (scaling is not None and scaling != ops.scale))
    if not unsupported:
        q_length, k_length = query.shape[2], key.shape[2]
        tracked = torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad)
        if q_length == 1 < k_length and not tracked and key.is_contiguous() and value.is_contiguous():
            # A decode step; the decode op is inference only, so a call that records gradients
            # stays on AttentionFwdOp.
            if attention_mask is None:
                key_mask = None
                served = sliding_window is None or k_length <= sliding_window  # the window holds the cache
            else:
                key_mask = _key_mask(attention_mask, query.shape[0], k_length)
                served = key_mask is not None
            if served:
                lengths = _lengths(key_mask, query.shape[0], k_length, query.device)
                inputs = {"q": query.transpose(1, 2), "k_cache": key, "v_cache": value, "cache_seqlens": lengths}
                if key_mask is not None:
                    inputs["key_mask"] = key_mask
                if ops.kernels_serve(ops.decode, inputs):
                    return ops.decode(**inputs)[0], None
    if not unsupported and attention_mask is None:  # q_length and k_length were read above
        if causal and 1 < q_length < k_length:
            # No mask with more keys than queries: a prefill into an empty static cache, whose rows
            # past the queries are unfilled; the mask builder aligns it to the top left.
            key, value = key[:, :, :q_length], value[:, :, :q_length]
        layout = _layout(query, key, value)
        inputs = [t.transpose(1, 2) for t in (query, key, value)] if layout == "bshd" else [query, key, value]
        op = ops.get(layout, _window(sliding_window))
        if op is not None and ops.kernels_serve(op, dict(zip("qkv", inputs))):
            if layout == "bshd":
                return op(*inputs)[0], None
            return op(*inputs)[0].transpose(1, 2).contiguous(), None
    if _sdpa is None:
        register()
    return _sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal,
                 sliding_window=sliding_window, **kwargs)


def attention_ops(module: torch.nn.Module, target: str | None, shared: dict) -> AttentionOps:
    """The ops ``module`` will call, built now (for no window and for its config's sliding
    window), shared through ``shared`` with the modules of the same causality and scale."""
    causal, scale = bool(getattr(module, "is_causal", True)), getattr(module, "scaling", None)
    ops = shared.get((causal, scale))
    if ops is None:
        ops = shared[causal, scale] = AttentionOps(causal, scale, target)
    ops.build(None)
    config = getattr(module, "config", None)
    for owner in (module, config):
        window = getattr(owner, "sliding_window", None)
        if _is_window(window):
            ops.build(_window(window))
    heads_q = getattr(config, "num_attention_heads", None)
    head_dim = getattr(module, "head_dim", None)
    if isinstance(heads_q, int) and isinstance(head_dim, int):
        ops.decide_ahead(heads_q, getattr(config, "num_key_value_heads", None) or heads_q, head_dim)
    return ops


# -- the rotation ----------------------------------------------------------------------------------


def _rotation(op: RotaryEmbeddingFwdOp, original: Callable) -> Callable:
    """transformers' ``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)`` on ``op``: cos
    and sin are each token's rows, (batch or 1, seq, D), so they are the op's caches and a token's
    position is its row there. A call the op cannot take (partial rotation, other shapes) goes to
    ``original``."""

    # Every layer of a forward rotates with the same cos and sin tensors (the model computes them
    # once), so the positions of the last call's tables serve the next: each layer's autograd
    # node keeps the positions it was given, and a contiguous copy per layer (the op copies an
    # expanded one) was 16 x 64 KiB of a 1.2B Llama's training step at its peak of memory.
    # The key holds the inference mode too: a tensor made under it cannot be saved for a backward.
    last: list[tuple[weakref.ref, int, bool, torch.Tensor] | None] = [None]

    def table_rows(cos: torch.Tensor, batch: int) -> torch.Tensor:
        """Each token's row of the (rows * tokens)-row tables, for every sequence of the batch."""
        rows, tokens = cos.shape[0], cos.shape[1]
        return torch.arange(rows * tokens, device=cos.device).view(rows, tokens).expand(batch, tokens)

    def positions_of(cos: torch.Tensor, batch: int) -> torch.Tensor:
        if torch.compiler.is_compiling():  # the compiler plans the memory; no state in a traced function
            return table_rows(cos, batch)
        inference = torch.is_inference_mode_enabled()
        held = last[0]
        if held is not None and held[0]() is cos and held[1:3] == (batch, inference):
            return held[3]
        positions = table_rows(cos, batch).contiguous()
        last[0] = (weakref.ref(cos), batch, inference, positions)
        return positions

    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        heads_at = {1: 1, 2: 2, -3: 1, -2: 2}.get(unsqueeze_dim) if q.dim() == 4 else None
        if (heads_at is None or cos.dim() != 3 or cos.shape[-1] != q.shape[-1] or k.shape[-1] != q.shape[-1]
                or cos.shape[0] not in (1, q.shape[0])):
            return original(q, k, cos, sin, unsqueeze_dim)
        rows, tokens = cos.shape[0], cos.shape[1]
        positions = positions_of(cos, q.shape[0])
        table_cos, table_sin = cos.reshape(rows * tokens, -1), sin.reshape(rows * tokens, -1)
        if heads_at == 2:
            return op(q, k, table_cos, table_sin, positions)
        q_rot, k_rot = op(q.transpose(1, 2), k.transpose(1, 2), table_cos, table_sin, positions)
        return q_rot.transpose(1, 2), k_rot.transpose(1, 2)

    return apply_rotary_pos_emb


#: The parameters of the ``apply_rotary_pos_emb`` the replacement stands in for (most of
#: transformers' models); others (one tensor at a time, position_ids) keep their own.
ROTATION_PARAMETERS = ("q", "k", "cos", "sin", "unsqueeze_dim")
#: The rotations the op computes, tried in turn against a model's function.
ROTATION_STYLES = ("neox", "interleaved")


@functools.cache
def rotation_style(original: Callable) -> str | None:
    """The op's ``style`` that computes what ``original`` (a model's ``apply_rotary_pos_emb``)
    computes, or None. Decided by running both on random q, k and caches on the CPU: the name is
    shared by rotations of halves (Llama's), of pairs (Cohere's) and of other inputs, and the
    replacement must not rotate a model's q and k otherwise than its own code."""
    try:
        parameters = inspect.signature(original).parameters
    except (TypeError, ValueError):
        return None
    if tuple(parameters) != ROTATION_PARAMETERS or parameters["unsqueeze_dim"].default != 1:
        return None
    generator = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, heads, 5, 8, generator=generator) for heads in (4, 2))
    cos, sin = (torch.randn(1, 5, 8, generator=generator) for _ in range(2))
    try:
        expected = original(q, k, cos, sin)
    except Exception:  # noqa: BLE001 - a function that does not take these is not the op's
        return None
    for style in ROTATION_STYLES:
        # These shapes are ones the replacement hands to the op (it falls back to ``original``
        # only for others), so the comparison is the op's against the model's.
        got = _rotation(RotaryEmbeddingFwdOp(style=style), original)(q, k, cos, sin)
        if all(torch.allclose(a, b, rtol=1e-5, atol=1e-5) for a, b in zip(got, expected)):
            return style
    return None


@functools.cache
def _rotating_class(cls: type, target: str | None, style: str) -> type:
    forward = inspect.unwrap(cls.forward)
    namespace = dict(forward.__globals__)
    # Without the module's name: torch.compile (2.11 and earlier) takes globals that name a
    # module for that module's, and guarded the rotation through the module's own function.
    del namespace["__name__"]
    op = RotaryEmbeddingFwdOp(style=style, target=target)
    namespace["apply_rotary_pos_emb"] = _rotation(op, namespace["apply_rotary_pos_emb"])
    rotated = types.FunctionType(forward.__code__, namespace, forward.__name__, forward.__defaults__, forward.__closure__)
    rotated.__kwdefaults__ = forward.__kwdefaults__
    rotated.__qualname__ = f"{cls.__qualname__}WithTileOPsRotation.forward"
    return type(f"{cls.__name__}WithTileOPsRotation", (cls,), {"forward": rotated, "__module__": __name__,
                                                                 "tileops_rotation": style, "tileops_original": cls})


def rotating_class(module: torch.nn.Module, target: str | None) -> type | str | None:
    """The class ``module`` becomes so that its rotation runs on TileOPs, a reason it cannot, or
    None where it is not an attention module."""
    cls = type(module)
    if getattr(cls, "tileops_rotation", False):
        return "its rotation already runs on TileOPs"
    if not cls.__name__.endswith("Attention"):
        return None
    forward = inspect.unwrap(cls.forward)
    if not isinstance(forward, types.FunctionType) or "apply_rotary_pos_emb" not in forward.__code__.co_names:
        return "its forward calls no apply_rotary_pos_emb"
    if "apply_rotary_pos_emb" not in forward.__globals__:
        return "apply_rotary_pos_emb is not a module-level function of its modeling code"
    original = forward.__globals__["apply_rotary_pos_emb"]
    style = rotation_style(original)
    if style is None:
        return (f"its apply_rotary_pos_emb{_signature_text(original)} is not q * cos + rotate(q) * sin of halves or "
                "of pairs on (batch, heads, seq, D) q and k (checked on random inputs)")
    return _rotating_class(cls, target, style)


def _signature_text(function: Callable) -> str:
    try:
        return str(inspect.signature(function))
    except (TypeError, ValueError):
        return ""
