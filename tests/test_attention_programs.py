"""The attention kernels: the launch rules, selection (which calls the TileLang kernels serve on
Hopper and which plain torch serves), the kernel classes on CPU tensors (compilation and the GPU
replaced) and the compile tier: one build of each program kind lowered and compiled for sm_90
(as sm_90a: wgmma and TMA) in a fresh interpreter, its source checked for pipeline buffers handed
back to the loads while a product still reads them."""

from __future__ import annotations

import pytest
import torch

from helpers import hand_backs_while_read, run_python
from tileops.core import DeviceFacts
from tileops.kernels.cuda.attention import KERNELS, policy, programs
from tileops.kernels.cuda.device import hopper_target
from tileops.ops.attention import AttentionBwdInterface, AttentionBwdOp, AttentionFwdInterface, AttentionFwdOp

CUDA = torch.device("cuda", 0)


def _facts(arch):
    return lambda call: DeviceFacts("cuda", arch, 132, 227 * 1024, "GPU")


def _selected(op, dtype, head_dim, heads_q=32, heads_kv=8, arch=90):
    (interface,) = op.kernel_interfaces
    call = op.call_spec(interface, CUDA, dtype, head_dim, heads_q, heads_kv)
    return op.implementations()[interface].select(call, _facts(arch))


@pytest.mark.parametrize("op_class", [AttentionFwdOp, AttentionBwdOp])
def test_hopper_calls_of_16_bit_dtypes_and_served_head_sizes_take_tilelang(op_class):
    for head_dim in policy.HEAD_DIMS:
        assert _selected(op_class(causal=True), torch.bfloat16, head_dim) == "tilelang"
        assert _selected(op_class(window=128, qkv_layout="bhsd"), torch.float16, head_dim, 16, 16) == "tilelang"
    assert _selected(op_class(), torch.bfloat16, 96) == "torch_cuda"  # a head size the kernels do not take
    assert _selected(op_class(), torch.float32, 128) == "torch_cuda"
    assert _selected(op_class(), torch.float64, 128) == "torch_cuda"
    assert _selected(op_class(), torch.bfloat16, 128, arch=80) == "torch_cuda"  # no wgmma before Hopper
    assert _selected(op_class(), torch.bfloat16, 128, heads_q=0, heads_kv=2) == "torch_cuda"


def test_the_refusals_say_what_the_kernels_take():
    assert "float16 and bfloat16" in policy.refusal(torch.float32, 128)
    assert "64, 128, 256" in policy.refusal(torch.bfloat16, 80)
    assert policy.refusal(torch.bfloat16, 256) is None


@pytest.mark.parametrize("head_dim", policy.HEAD_DIMS)
def test_the_tiles_fit_shared_memory_and_give_each_warpgroup_whole_wgmma_rows(head_dim):
    forward = policy.forward_config(head_dim)
    smem = (forward["block_m"] + 2 * forward["stages"] * forward["block_n"]) * head_dim * 2
    assert smem <= policy.SMEM_BYTES and forward["stages"] == 2
    # 64 query rows per consumer warpgroup: three where their O, S and P leave registers spare
    # (D = 64), else two.
    consumers = 3 if head_dim == 64 else 2
    assert forward["block_m"] == 64 * consumers and forward["threads"] == 128 * consumers
    backward = policy.backward_config(head_dim)
    n, m = backward["block_n"], backward["block_m"]
    smem = (3 * n * head_dim + 2 * n * m + 2 * backward["stages"] * m * head_dim) * 2
    assert smem <= policy.SMEM_BYTES
    assert backward["split_columns"] == (n < 128)  # two warpgroups of 64 rows, or split by columns
    # dK and dV in float32 registers: at most 128 of a consumer thread's 240
    assert 2 * n * head_dim // backward["threads"] <= 128
    # The dense backward's schedule on the same tiles; dQ through shared memory (a float32 tile)
    # only where it fits beside them.
    dense = policy.dense_backward_config(head_dim)
    assert dense == {**backward, "overlap": True, "per_query_head": True, "dq_by_tma": dense["dq_by_tma"]}
    assert dense["dq_by_tma"] == (smem + m * head_dim * 4 <= policy.SMEM_BYTES)
    assert policy.forward_candidates(head_dim)[0] == forward


def test_tuning_times_the_widest_key_tile_whose_scores_fit_the_registers_and_whose_stages_fit_shared_memory():
    # D = 128: 64 (O) + 96 (S) + 48 (P) + 32 spare registers of a consumer's 240 at 192 keys;
    # D = 256: 80 keys, where K and V two stages deep fill the 227 KiB beside Q; D = 64 (three
    # consumers, 160 registers): the rule's 128 already.
    assert [policy.widest_key_tile(2, 128), policy.widest_key_tile(2, 256), policy.widest_key_tile(3, 64)] == [192, 80, 128]
    for head_dim, widest in ((128, 192), (256, 80)):
        default, *others = policy.forward_candidates(head_dim)
        assert {**default, "block_n": widest} in others
        smem = (default["block_m"] + 2 * 2 * widest) * head_dim * 2
        assert smem <= policy.SMEM_BYTES < smem + 2 * 2 * 16 * head_dim * 2  # 16 keys more would not fit two stages
    assert all(c["block_n"] <= 128 for c in policy.forward_candidates(64))


@pytest.mark.parametrize("window", [None, 0, 100, 1023], ids=lambda w: f"window={w}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("block_n", [64, 128, 80, 192])
def test_the_forward_leaves_unmasked_exactly_the_key_blocks_every_row_sees_whole(causal, window, block_n):
    """The forward skips the mask of the key blocks ``whole_key_blocks`` names; an element-wise
    check of every row against every key of each block says which those must be."""
    pytest.importorskip("tilelang")
    import tvm

    simplify = tvm.arith.Analyzer().simplify
    block_m = 128
    for s_q in (1, 128, 300, 700):
        for s_k in (1, 127, 128, 129, 700):
            offset = s_k - s_q
            for q0 in range(0, s_q, block_m):
                first, end = (int(simplify(x)) for x in programs.whole_key_blocks(causal, window, q0, offset, s_k, block_m, block_n))
                rows = torch.arange(q0, q0 + block_m)[:, None]
                for kb in range(-(-s_k // block_n)):
                    cols = torch.arange(kb * block_n, (kb + 1) * block_n)[None, :]
                    seen = cols < s_k
                    if causal:
                        seen = seen & (cols <= rows + offset)
                    if window is not None:
                        seen = seen & (cols >= rows + offset - window)
                    assert (first <= kb < end) == bool(seen.all()), (s_q, s_k, q0, kb, first, end)


@pytest.mark.parametrize("window", [None, 0, 100, 1023], ids=lambda w: f"window={w}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_the_backward_leaves_unmasked_exactly_the_steps_whose_rows_all_see_their_key_block(causal, window):
    pytest.importorskip("tilelang")
    import tvm

    simplify = tvm.arith.Analyzer().simplify
    block_m, block_n = 64, 128
    for s_q in (1, 64, 300, 700):
        for s_k in (1, 127, 128, 129, 700):
            offset = s_k - s_q
            for k0 in range(0, s_k, block_n):
                cols = torch.arange(k0, k0 + block_n)[None, :]
                for q0 in range(0, s_q, block_m):
                    rows = torch.arange(q0, q0 + block_m)[:, None]
                    seen = (rows < s_q) & (cols < s_k)
                    if causal:
                        seen = seen & (cols <= rows + offset)
                    if window is not None:
                        seen = seen & (cols >= rows + offset - window)
                    whole = programs.sees_whole(causal, window, q0, k0, offset, s_q, s_k, block_m, block_n)
                    assert bool(simplify(whole)) == bool(seen.all()), (s_q, s_k, q0, k0)


# -- the kernel classes on CPU tensors ----------------------------------------------------------


@pytest.fixture
def launches(monkeypatch):
    """Kernels built for cuda:0 with every program replaced by a recorder, so that the
    production forward runs on CPU tensors; the list of (program, tensors) launched."""
    from tileops.kernels.cuda import kernel as kernel_module

    launched = []

    def recorder(name):
        return lambda call, target, **config: lambda *tensors: launched.append((name, config, tensors))

    monkeypatch.setattr(kernel_module, "compile_target", lambda device: {"kind": "cuda", "arch": "sm_90"})
    monkeypatch.setattr(kernel_module, "gpu_model", lambda device: "GPU")
    monkeypatch.setattr(kernel_module, "current_device_index", lambda: 0)
    for name in ("forward", "bwd_pre", "bwd_main", "bwd_post"):
        monkeypatch.setattr(programs, f"compile_{name}", recorder(name))
    return launched


def _kernel(op, interface, dtype, head_dim, heads_q, heads_kv):
    return KERNELS[interface]["tilelang"](op.call_spec(interface, CUDA, dtype, head_dim, heads_q, heads_kv))


@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_the_forward_kernel_allocates_o_like_q_and_a_float32_lse(launches, layout):
    kernel = _kernel(AttentionFwdOp(qkv_layout=layout), AttentionFwdInterface, torch.bfloat16, 64, 4, 2)
    shape = (2, 100, 4, 64) if layout == "bshd" else (2, 4, 100, 64)
    kv_shape = (2, 70, 2, 64) if layout == "bshd" else (2, 2, 70, 64)
    q, k, v = torch.zeros(shape, dtype=torch.bfloat16), torch.zeros(kv_shape, dtype=torch.bfloat16), torch.zeros(kv_shape, dtype=torch.bfloat16)
    o, lse = kernel.forward(q, k, v)
    name, config, tensors = launches[-1]
    assert name == "forward" and config == policy.forward_config(64)
    assert tensors[:3] == (q, k, v) and tensors[3] is o and tensors[4] is lse
    assert o.shape == q.shape and o.dtype == torch.bfloat16
    assert lse.dtype == torch.float32 and lse.shape == (2, shape[2], shape[1])


@pytest.mark.parametrize("with_dlse", [False, True])
def test_the_backward_runs_delta_main_and_cast_with_zeroed_padded_workspaces(launches, with_dlse):
    kernel = _kernel(AttentionBwdOp(causal=True), AttentionBwdInterface, torch.float16, 128, 8, 2)
    q = torch.zeros(3, 100, 8, 128, dtype=torch.float16)
    k = torch.zeros(3, 130, 2, 128, dtype=torch.float16)
    lse = torch.zeros(3, 8, 100)
    dlse = torch.ones(3, 8, 100) if with_dlse else None
    dq, dk, dv = kernel.forward(q, q, k, k, q, lse, dlse)
    assert [name for name, _, _ in launches] == ["bwd_pre", "bwd_main", "bwd_post"]
    (_, _, pre), (_, main_config, main), (_, _, post) = launches
    assert main_config == policy.dense_backward_config(128)
    delta, lse2 = pre[4], pre[5]
    assert delta.shape == lse2.shape == (3, 8, 128) and delta.dtype == torch.float32  # 100 rows padded to 128
    assert torch.equal(pre[3], dlse) if with_dlse else (pre[3].shape == lse.shape and not pre[3].any())
    dq_acc = main[6]
    assert dq_acc.shape == (3, 8, 128, 128) and dq_acc.dtype == torch.float32 and not dq_acc.any()
    assert main[4] is delta and main[5] is lse2
    # Four query heads per key/value head: dk and dv accumulate in float32, 130 key rows padded to
    # two 128-row key blocks, and are copied out.
    for accumulator in main[7:9]:
        assert accumulator.shape == (3, 256, 2, 128) and accumulator.dtype == torch.float32 and not accumulator.any()
    assert dk.shape == dv.shape == k.shape and dk.dtype == torch.float16
    assert post == (dq_acc, dq)
    assert dq.shape == q.shape and dk.shape == dv.shape == k.shape and dq.dtype == torch.float16


def test_sm90_is_compiled_as_sm90a():
    assert hopper_target({"kind": "cuda", "arch": "sm_90"}) == {"kind": "cuda", "arch": "sm_90a"}
    assert hopper_target({"kind": "cuda", "arch": "sm_90a"})["arch"] == "sm_90a"


# -- the compile tier ---------------------------------------------------------------------------

_PIPELINE = """
  if (((int)threadIdx.x) < 128) {
    for (int kb = 0; kb < n; ++kb) {
      mbarrier[((kb & 1) + 4)].wait((((kb & 3) >> 1) ^ 1));
      tl::tma_load(K_desc, mbarrier[(kb & 1)], (&(((bfloat16_t*)k_tile)[((kb & 1) * 8192)])), 0, kb * 64);
    }
  } else {
    tl::warpgroup_reg_alloc<240>();
    for (int kb_1 = 0; kb_1 < n; ++kb_1) {
      mbarrier[(kb_1 & 1)].wait(((kb_1 & 3) >> 1));
      tl::initialize_wgmma_descriptor<1, 1, 64>(desc_b, (&(((bfloat16_t*)k_tile)[0])));
      tl::warpgroup_commit_batch();
{hand_back_and_wait}
    }
  }
"""


@pytest.mark.parametrize("waited_first", [True, False])
def test_the_hand_back_check_flags_a_buffer_handed_back_before_its_product_is_waited_for(waited_first):
    wait, hand_back = "      tl::wait_wgmma<0>();", "      mbarrier[((kb_1 & 1) + 4)].arrive();"
    lines = [wait, hand_back] if waited_first else [hand_back, wait]
    buffer_of, early = hand_backs_while_read(_PIPELINE.replace("{hand_back_and_wait}", "\n".join(lines)))
    assert buffer_of == {"((kb & 1) + 4)": "k_tile"}
    assert early == ([] if waited_first else ["k_tile"])


COMPILE = """
import os
import subprocess
from pathlib import Path
import torch
from tileops.kernels.cuda.attention import policy, programs
from tileops.ops.attention import AttentionCall
target = {"kind": "cuda", "arch": "sm_90"}
device = torch.device("cuda", 0)
sources = Path(os.environ["KERNEL_SOURCES"])
# One build per program kind: the forward (GQA 32/8, D 128, causal, bf16; and D 64, whose blocks
# have three consumer warpgroups), the backward's main kernel as the dense backward runs it at
# D 256 (split columns, window, fp16, bhsd) and D 128, and its two row kernels.
fwd = AttentionCall(device, torch.bfloat16, 128, 32, 8, True, None, 128 ** -0.5, "bshd")
narrow = AttentionCall(device, torch.bfloat16, 64, 32, 8, False, None, 0.125, "bshd")
wide = AttentionCall(device, torch.float16, 256, 8, 8, False, 64, 0.0625, "bhsd")
for name, build in [
    ("forward", lambda: programs.compile_forward(fwd, target, **policy.forward_config(128))),
    ("forward_three_warpgroups", lambda: programs.compile_forward(narrow, target, **policy.forward_config(64))),
    ("bwd_main", lambda: programs.compile_bwd_main(fwd, target, **policy.dense_backward_config(128))),
    ("bwd_main_split", lambda: programs.compile_bwd_main(wide, target, **policy.dense_backward_config(256))),
    ("bwd_pre", lambda: programs.compile_bwd_pre(wide, target, **policy.ROWS_KERNEL)),
    ("bwd_post", lambda: programs.compile_bwd_post(fwd, target, **policy.ROWS_KERNEL)),
]:
    source = build().get_kernel_source()
    (sources / f"{name}.cu").write_text(source)
    print(name, "wgmma_" in source, "tma_load" in source, "AtomicAdd" in source or "tma_store_add" in source)
    if name == "bwd_main":  # the build whose products are issued asynchronously: what ptxas made of it
        from tilelang.contrib.nvcc import default_compile_options, find_cuda_path
        nvcc = os.path.join(find_cuda_path(), "bin", "nvcc")
        options = ["--cubin", "-O3", "-arch=sm_90a", *default_compile_options(), "-Xptxas", "-v"]
        command = [nvcc, *options, "-o", str(sources / f"{name}.cubin"), str(sources / f"{name}.cu")]
        report = subprocess.run(command, capture_output=True, text=True)
        (sources / f"{name}.ptxas").write_text(report.stdout + report.stderr)
"""


@pytest.mark.compile
def test_one_build_per_program_kind_compiles_for_sm90_with_wgmma_and_tma(tmp_path):
    result = run_python(COMPILE, env={"TILELANG_CACHE_DIR": str(tmp_path / "cache"), "KERNEL_SOURCES": str(tmp_path)})
    assert result.returncode == 0, result.stderr[-4000:]
    lines = [line.split() for line in result.stdout.splitlines() if line.split() and line.split()[0].startswith(("forward", "bwd"))]
    # name, wgmma, TMA loads, atomic adds (per thread, or dQ's TMA reduce-add)
    assert lines == [
        ["forward", "True", "True", "False"],
        ["forward_three_warpgroups", "True", "True", "False"],
        ["bwd_main", "True", "True", "True"],
        ["bwd_main_split", "True", "True", "True"],
        ["bwd_pre", "False", "False", "False"],
        ["bwd_post", "False", "False", "False"],
    ], result.stdout[-3000:]
    for name in ("forward", "forward_three_warpgroups", "bwd_main", "bwd_main_split"):
        loaded, handed_back_early = hand_backs_while_read((tmp_path / f"{name}.cu").read_text())
        assert loaded, f"{name}: no pipelined loads found in the source; the check below would pass vacuously"
        assert not handed_back_early, f"{name}: buffers handed back to the loads while a product reads them: {handed_back_early}"
    # ptxas notes where it runs asynchronously issued products one after another (C7514) or waits
    # for one before the program does (C7517): the backward's schedule would then not overlap them.
    report = (tmp_path / "bwd_main.ptxas").read_text()
    assert "Used" in report and "registers" in report, report[-2000:]
    assert "C7514" not in report and "C7517" not in report, report[-2000:]
