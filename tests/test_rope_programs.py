"""The rope kernels' launch rule and selection (pure Python: no tilelang, no GPU), and the
compile tier: one representative build of each kernel kind lowered and compiled for sm_90."""

from __future__ import annotations

import pytest
import torch

from helpers import run_python
from tileops.kernels.cuda import rope as rope_kernels
from tileops.ops import RotaryEmbeddingBwdOp, RotaryEmbeddingFwdOp, RotaryEmbeddingInplaceFwdOp

CUDA = torch.device("cuda", 0)


def _selected(op, dtype, heads_q, heads_k, head_dim, aligned=True, cos_dtype=torch.float32):
    (interface,) = op.kernel_interfaces
    implementations = op.implementations()[interface]
    call = op.call_spec(interface, CUDA, dtype, cos_dtype, heads_q, heads_k, head_dim, aligned)
    return implementations.select(call)


@pytest.mark.parametrize("op_class", [RotaryEmbeddingFwdOp, RotaryEmbeddingBwdOp])
def test_model_heads_take_the_vectorised_kernel_and_the_rest_the_general_one(op_class):
    assert _selected(op_class(), torch.bfloat16, 32, 8, 128) == "tilelang"
    assert _selected(op_class(64, "interleaved"), torch.float16, 16, 16, 256) == "tilelang"
    assert _selected(op_class(32), torch.float32, 32, 32, 80) == "tilelang"  # Phi-2: 16 pairs, 4-float vectors
    assert _selected(op_class(), torch.bfloat16, 32, 8, 128, aligned=False) == "tilelang_general"
    assert _selected(op_class(6), torch.bfloat16, 3, 1, 10) == "tilelang_general"  # 3 pairs: no whole vector
    assert _selected(op_class(24), torch.bfloat16, 32, 32, 80) == "tilelang_general"  # 12 pairs, 8-wide vectors
    assert _selected(op_class(), torch.float64, 4, 2, 64) == "torch_float64"


def test_the_in_place_op_takes_the_tilelang_rotation_for_every_16_and_32_bit_call():
    assert _selected(RotaryEmbeddingInplaceFwdOp(), torch.bfloat16, 32, 8, 128) == "tilelang"
    assert _selected(RotaryEmbeddingInplaceFwdOp(6), torch.float16, 3, 1, 9, aligned=False) == "tilelang"
    assert _selected(RotaryEmbeddingInplaceFwdOp(), torch.float64, 4, 2, 64) == "torch_float64"
    assert _selected(RotaryEmbeddingInplaceFwdOp(), torch.float32, 4, 2, 64, cos_dtype=torch.float64) == "torch_float64"


def test_the_vectorised_refusal_says_what_the_general_kernel_serves():
    op = RotaryEmbeddingFwdOp(6)
    call = op.call_spec(RotaryEmbeddingFwdOp.kernel_interfaces[0], CUDA, torch.bfloat16, torch.float32, 3, 1, 10, True)
    reason = rope_kernels.TileLangRope.refusal(call)
    assert "whole 16-byte vectors of 8" in reason and "general variant" in reason
    assert rope_kernels.TileLangRopeGeneral.refusal(call) is None


@pytest.mark.parametrize(
    ("units", "threads"),
    [
        (320, 160),  # Llama 3 8B, bf16: 40 heads of 8 units, two blocks of 5 warps per token
        (576, 192),  # Llama 2 70B: 72 heads, three blocks of 6 warps
        (256, 256),  # Qwen2 7B: 32 heads
        (24, 32),  # a small head: one warp
        (1000, 256),  # 4 blocks, the last 232 of 256 busy: ties go to the largest block
    ],
)
def test_threads_per_block_leave_the_fewest_threads_idle(units, threads):
    assert rope_kernels.launch_threads(units) == threads
    assert threads % 32 == 0 and 32 <= threads <= 256


COMPILE = """
import torch
from tileops.kernels.cuda.rope import programs
target = {"kind": "cuda", "arch": "sm_90"}
# One build per kernel kind: the vectorised forward (Llama 3 8B, float32 caches), the general
# forward (partial, odd sizes), the vectorised backward (interleaved, GPT-J), the general
# backward, and the in-place build of the vectorised forward.
for name, args, config in [
    ("forward", (torch.bfloat16, torch.float32, 32, 8, 128, 128, "neox", False), dict(vec=8, pass_vec=8, threads=160)),
    ("general", (torch.float16, torch.float16, 3, 1, 9, 6, "neox", False), dict(vec=1, pass_vec=1, threads=32)),
    ("backward", (torch.float32, torch.float32, 16, 16, 256, 64, "interleaved", True), dict(vec=4, pass_vec=4, threads=256)),
    ("general_backward", (torch.bfloat16, torch.float32, 3, 1, 9, 6, "interleaved", True), dict(vec=2, pass_vec=1, threads=32)),
    ("inplace", (torch.bfloat16, torch.bfloat16, 32, 8, 128, 128, "neox", False), dict(vec=8, pass_vec=8, threads=160, inplace=True)),
]:
    source = programs.compile_program(*args, target, **config).get_kernel_source()
    declaration = next(line for line in source.splitlines() if "__global__" in line)
    # A position outside the caches reads zeros: every cache load is guarded by the row's range.
    guarded = source.count("< p)") >= 2
    print(name, "uint4" in source or "float4" in source, "q_rot" in declaration, "sin" in declaration, guarded)
"""


@pytest.mark.compile
def test_one_build_per_kernel_kind_compiles_for_sm90(tmp_path):
    result = run_python(COMPILE, env={"TILELANG_CACHE_DIR": str(tmp_path)})
    assert result.returncode == 0, result.stderr[-4000:]
    lines = [line for line in result.stdout.splitlines() if line.split()[0] in
             ("forward", "general", "backward", "general_backward", "inplace")]
    # 16-byte accesses in the vectorised builds only; the in-place build writes q and k, no outputs.
    assert lines == ["forward True True True True", "general False True True True", "backward True True True True",
                     "general_backward False True True True", "inplace True False True True"], result.stdout[-2000:]
