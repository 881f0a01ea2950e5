"""Row views: tensors whose rows are dense and follow one another at a fixed pitch.

A row is a tensor's trailing dimensions taken together; a row view is laid out as a slice of a
wider row-major tensor (``wide[..., :n]``, one of the q/k/v thirds of a fused projection): each
row dense, the leading dimensions flattening to one stride between rows, at least a row long.
An input declared ``row_views: true`` reaches the op's in-tree implementations as such a view
without the contiguous copy every other read input gets; a kernel reads it with the pitch.
"""

from __future__ import annotations

import torch


def is_row_view(tensor: torch.Tensor, row_rank: int) -> bool:
    """Whether ``tensor`` is a row view whose rows are its last ``row_rank`` dimensions (sizes
    of 1 take any stride, as torch's contiguity does)."""
    shape, strides = tensor.shape, tensor.stride()
    lead = len(shape) - row_rank
    if lead < 0:
        return False
    dense = 1
    for i in range(len(shape) - 1, lead - 1, -1):
        if shape[i] != 1 and strides[i] != dense:
            return False
        dense *= shape[i]
    step = None  # the stride the next leading dimension must have, once a pitch is seen
    for i in range(lead - 1, -1, -1):
        if shape[i] == 1:
            continue
        if step is None:
            if strides[i] < dense:  # rows that overlap (a broadcast) are no slice of a wider tensor
                return False
            step = strides[i]
        elif strides[i] != step:
            return False
        step *= shape[i]
    return True


def row_pitch(tensor: torch.Tensor, row_rank: int) -> int:
    """The elements from one row of the row view ``tensor`` to the next (its rows are its last
    ``row_rank`` dimensions): the stride of its innermost leading dimension of more than one
    element; a row's length where it has a single row."""
    shape, strides = tensor.shape, tensor.stride()
    for i in range(len(shape) - row_rank - 1, -1, -1):
        if shape[i] != 1:
            return strides[i]
    length = 1
    for size in shape[len(shape) - row_rank:]:
        length *= size
    return length
