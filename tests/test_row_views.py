"""Row views: the layout an input declared ``row_views: true`` may keep on its way to the op's
in-tree implementations, and what the reference bind, the generated path and a target do with it."""

from __future__ import annotations

import pytest
import torch

from helpers import generated_bind
from tileops.backend import register_kernel_builder
from tileops.core import is_row_view, row_pitch
from tileops.ops import FusedAddRMSNormFwdOp, LayerNormFwdOp, RMSNormFwdOp

WIDE = torch.arange(4 * 5 * 96, dtype=torch.float32).view(4, 5, 96)


@pytest.mark.parametrize(
    ("tensor", "row_rank", "view", "pitch"),
    [
        (WIDE[..., :32], 1, True, 96),  # a slice of wider rows, 3-D: its leading dimensions flatten
        (WIDE[..., 32:64], 1, True, 96),  # the middle third of a fused projection
        (WIDE.view(20, 96)[:, 40:72], 1, True, 96),
        (WIDE[:, :3], 1, False, None),  # rows at 96, batches at 480: no single pitch
        (WIDE[:, :3], 2, True, 480),  # ...but a row of (3, 96) steps at one
        (WIDE.transpose(0, 1), 1, False, None),
        (WIDE[..., ::2], 1, False, None),  # rows with gaps inside them
        (WIDE[:, :, :1].expand(4, 5, 32), 1, False, None),  # a broadcast row is not dense
        (WIDE[:1, :1, :32], 1, True, 32),  # a single row: its length
        (WIDE[:, :1, :32], 1, True, 480),  # a dimension of size 1 takes any stride
        (torch.zeros(3, 8)[:, :8].expand(2, 3, 8), 1, False, None),  # rows repeated: no single pitch
    ],
)
def test_a_row_view_is_dense_rows_at_one_pitch_at_least_a_row_long(tensor, row_rank, view, pitch):
    assert is_row_view(tensor, row_rank) is view
    if view:
        assert row_pitch(tensor, row_rank) == pitch


def test_the_reference_bind_passes_a_declared_row_view_as_it_is_and_copies_other_layouts():
    op = FusedAddRMSNormFwdOp(32)
    x, residual = WIDE[..., :32], WIDE[..., 64:]
    call = op.signature().bind(op.params, (x, residual), {})
    assert call.inputs[0] is x and call.inputs[1] is residual
    transposed = WIDE[..., :32].transpose(0, 1)
    call = op.signature().bind(op.params, (transposed, residual.transpose(0, 1)), {})
    assert call.inputs[0].is_contiguous() and torch.equal(call.inputs[0], transposed)
    # weight declares no row views: a strided one is copied.
    weight = torch.randn(64)[::2]
    call = op.signature().bind(op.params, (x, residual, weight), {})
    assert call.inputs[2].is_contiguous() and torch.equal(call.inputs[2], weight)


def test_the_row_is_what_normalized_shape_names():
    # normalized_shape (5, 32): a row is a (5, 32) block, dense only where the slice keeps it so.
    op = LayerNormFwdOp((5, 32))
    blocks = torch.randn(4, 5, 32 * 3)
    sliced = blocks[..., :32]  # each (5, 32) block has rows 96 apart: not one dense row
    assert op.signature().bind(op.params, (sliced,), {}).inputs[0].is_contiguous()
    dense_blocks = torch.randn(4, 2, 5, 32)[:, 0]  # (4, 5, 32), blocks 320 apart
    assert op.signature().bind(op.params, (dense_blocks,), {}).inputs[0] is dense_blocks


def test_the_generated_path_takes_a_row_view_and_declines_other_layouts():
    op = FusedAddRMSNormFwdOp(32)
    x, residual = WIDE[..., :32], WIDE[..., 64:]
    fast = generated_bind(op.signature(), op.params, (x, residual))
    assert fast is not None and fast.inputs[0] is x and fast.inputs[1] is residual
    assert generated_bind(op.signature(), op.params, (x.transpose(0, 1), residual.transpose(0, 1))) is None


def test_a_target_gets_a_row_view_contiguous(scoped_registry):
    seen = []

    def build(x, weight, **params):
        def kernel(x, weight):
            seen.append(x)
            return torch.zeros_like(x)

        return kernel

    register_kernel_builder(op="RMSNormFwdOp", target="rowprobe", build_kernel=build)
    x = WIDE[..., :32]
    RMSNormFwdOp(32, target="rowprobe")(x)
    (got,) = seen
    assert got.is_contiguous() and torch.equal(got, x)
