"""The variable-length attention kernels: selection (which calls the TileLang kernels serve on
Hopper and which plain torch serves), the tile-to-sequence map, the kernel classes on CPU tensors
(compilation and the GPU replaced by recorders) and the compile tier: one build of each program
kind lowered and compiled for sm_90 (as sm_90a: wgmma and TMA) in a fresh interpreter."""

from __future__ import annotations

import random

import pytest
import torch

from helpers import hand_backs_while_read, run_python
from tileops.core import DeviceFacts
from tileops.kernels.cuda.attention import policy, varlen, varlen_programs
from tileops.ops.attention import (
    VarlenAttentionBwdInterface,
    VarlenAttentionBwdOp,
    VarlenAttentionFwdInterface,
    VarlenAttentionFwdOp,
)

CUDA = torch.device("cuda", 0)


def _selected(op, dtype, head_dim, heads_q=32, heads_kv=8, arch=90):
    (interface,) = op.kernel_interfaces
    call = op.call_spec(interface, CUDA, dtype, head_dim, heads_q, heads_kv)
    return op.implementations()[interface].select(call, lambda call: DeviceFacts("cuda", arch, 132, 227 * 1024, "GPU"))


@pytest.mark.parametrize("op_class", [VarlenAttentionFwdOp, VarlenAttentionBwdOp])
def test_hopper_calls_of_16_bit_dtypes_and_served_head_sizes_take_tilelang(op_class):
    for head_dim in policy.HEAD_DIMS:
        assert _selected(op_class(causal=True), torch.bfloat16, head_dim) == "tilelang"
        assert _selected(op_class(window=128), torch.float16, head_dim, 16, 16) == "tilelang"
    assert _selected(op_class(), torch.bfloat16, 96) == "torch_cuda"  # a head size the kernels do not take
    assert _selected(op_class(), torch.float32, 128) == "torch_cuda"
    assert _selected(op_class(), torch.bfloat16, 128, arch=80) == "torch_cuda"  # no wgmma before Hopper


def test_every_sequence_gets_a_tile_per_block_of_its_rows_from_its_first_tile():
    generator = random.Random(0)
    for _ in range(300):
        block = generator.choice([1, 3, 64, 128])
        lengths = [generator.choice([0, 1, 2, 63, 64, 65, 128, 129, 300]) for _ in range(generator.randint(1, 9))]
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        owner = varlen.tile_sequences(cu, block, int(cu[-1])).tolist()
        assert len(owner) == int(cu[-1]) // block + len(lengths)
        for b, length in enumerate(lengths):
            first = int(cu[b]) // block + b  # the kernels' first tile of sequence b
            assert owner[first : first + -(-length // block)] == [b] * -(-length // block)
            assert all(t >= first for t, s in enumerate(owner) if s == b)


def test_offsets_that_break_the_rules_still_map_every_tile_to_a_sequence():
    owner = varlen.tile_sequences(torch.tensor([0, 900, 5, -7, 40], dtype=torch.int32), 64, 40)
    assert owner.dtype == torch.int32 and int(owner.min()) >= 0 and int(owner.max()) <= 3


# -- the kernel classes on CPU tensors ----------------------------------------------------------


@pytest.fixture
def launches(monkeypatch):
    """Kernels built for cuda:0 with every program replaced by a recorder, so that the
    production forward runs on CPU tensors; the list of (program, config, tensors) launched."""
    launched = []

    def recorder(name):
        return lambda call, target, **config: lambda *tensors: launched.append((name, config, tensors))

    monkeypatch.setattr(varlen, "compile_target", lambda device: {"kind": "cuda", "arch": "sm_90"})
    monkeypatch.setattr(varlen, "current_device_index", lambda: 0)
    monkeypatch.setattr(varlen, "entry_function", lambda compiled: compiled)
    for name in ("forward", "bwd_pre", "bwd_main", "bwd_post"):
        monkeypatch.setattr(varlen_programs, f"compile_{name}", recorder(name))
    return launched


def _kernel(op, interface, dtype, head_dim, heads_q, heads_kv):
    return varlen.KERNELS[interface]["tilelang"](op.call_spec(interface, CUDA, dtype, head_dim, heads_q, heads_kv))


def test_the_forward_maps_query_tiles_and_allocates_o_like_q_and_an_lse_of_heads_by_rows(launches):
    kernel = _kernel(VarlenAttentionFwdOp(causal=True), VarlenAttentionFwdInterface, torch.bfloat16, 128, 4, 2)
    q, k = torch.zeros(300, 4, 128, dtype=torch.bfloat16), torch.zeros(170, 2, 128, dtype=torch.bfloat16)
    cu_q, cu_k = torch.tensor([0, 100, 100, 300], dtype=torch.int32), torch.tensor([0, 70, 90, 170], dtype=torch.int32)
    o, lse = kernel.forward(q, k, k, cu_q, cu_k)
    ((name, config, tensors),) = launches
    assert name == "forward" and config == policy.forward_config(128) and config["block_m"] == 128
    assert all(a is b for a, b in zip(tensors[:5], (q, k, k, cu_q, cu_k))) and tensors[6] is o and tensors[7] is lse
    # 300 // 128 + 3 tiles: sequence 0's, the empty sequence 1's spare, then sequence 2's from tile 100 // 128 + 2
    assert tensors[5].tolist() == [0, 1, 2, 2, 2]
    assert o.shape == q.shape and o.dtype == torch.bfloat16 and lse.shape == (4, 300) and lse.dtype == torch.float32


@pytest.mark.parametrize("with_dlse", [False, True])
def test_the_backward_runs_delta_main_and_cast_with_zeroed_padded_workspaces(launches, with_dlse):
    kernel = _kernel(VarlenAttentionBwdOp(causal=True), VarlenAttentionBwdInterface, torch.float16, 128, 8, 2)
    q, k = torch.zeros(100, 8, 128, dtype=torch.float16), torch.zeros(130, 2, 128, dtype=torch.float16)
    cu_q, cu_k = torch.tensor([0, 40, 100], dtype=torch.int32), torch.tensor([0, 0, 130], dtype=torch.int32)
    lse = torch.zeros(8, 100)
    dlse = torch.ones(8, 100) if with_dlse else None
    dq, dk, dv = kernel.forward(q, q, k, k, q, lse, cu_q, cu_k, dlse)
    assert [name for name, _, _ in launches] == ["bwd_pre", "bwd_main", "bwd_post"]
    (_, _, pre), (_, main_config, main), (_, _, post) = launches
    assert main_config == policy.backward_config(128)
    delta, lse2 = pre[4], pre[5]
    assert delta.shape == lse2.shape == (8, 164) and delta.dtype == torch.float32  # a 64-row tile past T_q
    assert torch.equal(pre[3], dlse) if with_dlse else (pre[3].shape == lse.shape and not pre[3].any())
    # 130 // 128 + 2 key tiles: the empty sequence 0's spare, then sequence 1's two
    assert main[4] is cu_q and main[5] is cu_k and main[6].tolist() == [0, 1, 1]
    dq_acc = main[9]
    assert dq_acc.shape == (8, 164, 128) and dq_acc.dtype == torch.float32 and not dq_acc.any()
    assert main[7] is delta and main[8] is lse2 and main[10] is dk and main[11] is dv
    assert post[0] is dq_acc and post[1] is dq
    assert dq.shape == q.shape and dk.shape == dv.shape == k.shape and dq.dtype == torch.float16


# -- the compile tier ---------------------------------------------------------------------------

COMPILE = """
import os
from pathlib import Path
import torch
from tileops.kernels.cuda.attention import policy, varlen_programs as programs
from tileops.ops.attention import VarlenAttentionCall
target = {"kind": "cuda", "arch": "sm_90"}
device = torch.device("cuda", 0)
# One build per program kind: the forward (GQA 32/8, D 128, causal, bf16), the backward's main
# kernel (D 128), and its two row kernels.
call = VarlenAttentionCall(device, torch.bfloat16, 128, 32, 8, True, None, 128 ** -0.5)
for name, build in [
    ("forward", lambda: programs.compile_forward(call, target, **policy.forward_config(128))),
    ("bwd_main", lambda: programs.compile_bwd_main(call, target, **policy.backward_config(128))),
    ("bwd_pre", lambda: programs.compile_bwd_pre(call, target, **policy.ROWS_KERNEL)),
    ("bwd_post", lambda: programs.compile_bwd_post(call, target, **policy.ROWS_KERNEL)),
]:
    source = build().get_kernel_source()
    (Path(os.environ["KERNEL_SOURCES"]) / f"{name}.cu").write_text(source)
    print(name, "wgmma_" in source, "tma_load" in source, "AtomicAdd" in source)
"""


@pytest.mark.compile
def test_one_build_per_program_kind_compiles_for_sm90_with_wgmma_and_tma(tmp_path):
    result = run_python(COMPILE, env={"TILELANG_CACHE_DIR": str(tmp_path / "cache"), "KERNEL_SOURCES": str(tmp_path)})
    assert result.returncode == 0, result.stderr[-4000:]
    lines = [line.split() for line in result.stdout.splitlines() if line.split() and line.split()[0].startswith(("forward", "bwd"))]
    # name, wgmma, TMA loads, atomics
    assert lines == [
        ["forward", "True", "True", "False"],
        ["bwd_main", "True", "True", "True"],
        ["bwd_pre", "False", "False", "False"],
        ["bwd_post", "False", "False", "False"],
    ], result.stdout[-3000:]
    for name in ("forward", "bwd_main"):
        loaded, handed_back_early = hand_backs_while_read((tmp_path / f"{name}.cu").read_text())
        assert loaded, f"{name}: no pipelined loads found in the source; the check below would pass vacuously"
        assert not handed_back_early, f"{name}: buffers handed back to the loads while a product reads them: {handed_back_early}"
