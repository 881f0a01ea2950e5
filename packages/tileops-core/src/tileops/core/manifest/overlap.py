"""Whether the tensors of a call share memory: the rule that no tensor a call writes overlaps
another of its tensors.

Two tensors whose byte ranges do not meet share nothing. Where they meet, two views of one
dtype with the same strides (q and k sliced from one fused qkv projection, ``t[::2]`` and
``t[1::2]``) are compared element by element in closed form: they share an element exactly when
their offset is a sum of whole strides that both views' sizes allow. Any other pair whose
ranges meet counts as overlapping, which only refuses a call the rule cannot decide cheaply.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

#: The most index combinations the exact comparison explores before it gives up and counts
#: the pair as overlapping (views whose strides nest, as every slice of a contiguous tensor
#: does, need a few per dimension).
_MOST_STEPS = 4096


def _memory_span(tensor: torch.Tensor) -> tuple[int, int] | None:
    """[first, last] byte address ``tensor`` may touch, or None when it touches no memory
    (empty, or on the meta device)."""
    count = tensor.numel()
    if count == 0 or tensor.is_meta:
        return None
    start = tensor.data_ptr()
    # A contiguous tensor (every one the call path passes) spans its elements: no strides to sum.
    last = count - 1 if tensor.is_contiguous() else sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    return start, start + (last + 1) * tensor.element_size() - 1


def _offset_reachable(offset: int, dims: list[tuple[int, int, int]]) -> bool | None:
    """Whether ``offset`` (in elements) is ``sum(d * stride)`` with ``-(b_size - 1) <= d <=
    a_size - 1`` for each (stride, a_size, b_size) of ``dims`` (strides descending): an element
    of view a and one of view b at that offset apart are the same. None: undecided in
    ``_MOST_STEPS`` steps."""
    # The offsets the dimensions after the i-th can still make up, lowest and highest.
    low, high = [0] * (len(dims) + 1), [0] * (len(dims) + 1)
    for i in reversed(range(len(dims))):
        stride, a_size, b_size = dims[i]
        low[i] = low[i + 1] - (b_size - 1) * stride
        high[i] = high[i + 1] + (a_size - 1) * stride
    steps = 0
    pending = [(0, offset)]
    while pending:
        i, rest = pending.pop()
        steps += 1
        if steps > _MOST_STEPS:
            return None
        if i == len(dims):
            if rest == 0:
                return True
            continue
        stride, a_size, b_size = dims[i]
        # This dimension's d leaves a rest the later ones can make up: low[i+1] <= rest - d * stride <= high[i+1].
        first = max(-(b_size - 1), -((high[i + 1] - rest) // stride))
        last = min(a_size - 1, (rest - low[i + 1]) // stride)
        pending.extend((i + 1, rest - d * stride) for d in range(first, last + 1))
    return False


def _share_elements(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b``, whose byte ranges meet, may share memory: decided exactly for
    views of one element size and the same strides, else assumed."""
    if a.element_size() != b.element_size() or a.stride() != b.stride() or a.dim() != b.dim():
        return True
    size = a.element_size()
    gap = b.data_ptr() - a.data_ptr()
    if gap % size:
        return True  # elements straddle each other's bytes
    dims = []
    for stride, a_size, b_size in zip(a.stride(), a.shape, b.shape):
        if a_size == 1 and b_size == 1:
            continue  # no index to vary: its stride does not matter
        if stride == 0:
            return True  # a broadcast view repeats its own elements; no such view is written
        dims.append((stride, a_size, b_size))
    dims.sort(reverse=True)
    reachable = _offset_reachable(gap // size, dims)
    return True if reachable is None else reachable


def overlapping(written: Sequence[tuple[str, torch.Tensor]], read: Sequence[tuple[str, torch.Tensor]]):
    """The names of the first pair of tensors that share memory, where one of each pair is in
    ``written`` (tensors the call writes) and the other in ``written`` or ``read``; or None.

    Spans are compared by address, so views of one storage and distinct storages over the
    same memory are both caught; where spans meet, views of the same strides are compared
    element by element (see the module)."""
    tensors = [*written, *read]
    spans = [(name, tensor, _memory_span(tensor)) for name, tensor in tensors]
    for i, (name, tensor, span) in enumerate(spans[: len(written)]):
        if span is None:
            continue
        for other, other_tensor, other_span in spans[i + 1 :]:
            if (  # addresses first: comparing devices builds two device objects
                other_span is not None
                and span[0] <= other_span[1]
                and other_span[0] <= span[1]
                and other_tensor.device == tensor.device
                and _share_elements(tensor, other_tensor)
            ):
                return name, other
    return None
