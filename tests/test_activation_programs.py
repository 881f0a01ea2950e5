"""The activation kernels: their launch rules, the kernel classes on CPU tensors (compilation
and the GPU replaced), and the compile tier (one representative build per kernel kind,
compiled for sm_90 in a fresh interpreter)."""

from __future__ import annotations

import pytest
import torch

from helpers import run_python, tuning_timed_by_config
from tileops.kernels.cuda.row_layout import vector_width
from tileops.kernels.cuda.activation import KERNELS, policy, programs
from tileops.ops.activation import (
    ActivationFwdInterface,
    GatedBwdInterface,
    GatedFwdInterface,
    GatedInplaceBwdInterface,
    PackedGatedBwdInterface,
    PackedGatedFwdInterface,
    PackedGatedInplaceBwdInterface,
    PackedSwiGLUBwdOp,
    PackedSwiGLUFwdOp,
    PackedSwiGLUInplaceBwdOp,
    SiLUFwdOp,
    SwiGLUBwdOp,
    SwiGLUFwdOp,
    SwiGLUInplaceBwdOp,
)

CUDA = torch.device("cuda", 0)


def test_every_kind_has_a_kernel_and_every_interface_one_general_key():
    assert sorted(cls.kind for table in KERNELS.values() for cls in table.values()) == sorted(programs.KINDS)
    for table in KERNELS.values():
        assert list(table) == ["tilelang"] and table["tilelang"].general


def test_one_build_of_128_thread_blocks_and_one_16_byte_access_a_thread_serves_every_call():
    config = policy.launch_config(torch.bfloat16, True)
    assert config == {"vec": 8, "threads": 128, "per_thread": 1}  # 1024 elements a block
    assert policy.launch_config(torch.float32, True)["vec"] * 4 == 16
    candidates = policy.tuning_candidates(torch.bfloat16, True)
    assert candidates[0] == config and len({tuple(c.items()) for c in candidates}) == len(candidates)
    assert all(c["vec"] == 8 for c in candidates) and {"threads": 256, "per_thread": 4} in [
        {k: c[k] for k in ("threads", "per_thread")} for c in candidates
    ]


def test_the_access_is_16_bytes_where_aligned_and_one_element_otherwise():
    assert [vector_width(dtype, True) for dtype in policy.DTYPES] == [8, 8, 4]
    assert {vector_width(dtype, False) for dtype in policy.DTYPES} == {1}
    assert policy.refusal(torch.float64) and policy.refusal(torch.bfloat16) is None


def test_the_ops_call_a_call_aligned_only_when_every_access_can_be_16_bytes():
    silu = SiLUFwdOp()
    spec = silu.call_specs(CUDA, {"x": _described((4, 1001), torch.bfloat16)})
    assert spec[ActivationFwdInterface].aligned is False  # 4004 elements: not whole 16-byte accesses
    spec = silu.call_specs(CUDA, {"x": _described((4, 1000), torch.bfloat16)})
    assert spec[ActivationFwdInterface].aligned is True
    spec = silu.call_specs(CUDA, {"x": _described((4, 1000), torch.bfloat16, address=2)})
    assert spec[ActivationFwdInterface].aligned is False
    packed = PackedSwiGLUFwdOp(1001)  # the halves' boundary is what matters: d, not 2 * d
    spec = packed.call_specs(CUDA, {"x": _described((4, 2002), torch.float32)})
    assert spec[PackedGatedFwdInterface].aligned is False and spec[PackedGatedFwdInterface].d == 1001
    spec = PackedSwiGLUFwdOp(1024).call_specs(CUDA, {"x": _described((4, 2048), torch.float32)})
    assert spec[PackedGatedFwdInterface].aligned is True


def _described(shape, dtype, address=0):
    from tileops.core.tensor_description import TensorDescription

    return TensorDescription(CUDA, dtype, tuple(shape), address)


# -- the kernel classes on CPU tensors ----------------------------------------------------------


@pytest.fixture
def launches(monkeypatch):
    """Kernels built for cuda:0 with their programs and the C++ launcher replaced,
    so that the production forward runs on CPU tensors; the list of (config, rank, tensors)."""
    from tileops.kernels.cuda import fast_launch
    from tileops.kernels.cuda import kernel as kernel_module

    launched = []

    def compiled(self, config, rank):
        return lambda *tensors: launched.append((config, rank, tensors))

    monkeypatch.setattr(kernel_module, "compile_target", lambda device: {"kind": "cuda", "arch": "sm_90"})
    monkeypatch.setattr(kernel_module, "gpu_model", lambda device: "GPU")
    monkeypatch.setattr(kernel_module, "current_device_index", lambda: 0)
    monkeypatch.setattr(fast_launch, "launcher", lambda *args, **kwargs: None)
    monkeypatch.setattr(kernel_module.TileLangKernel, "_launch_function", compiled)
    return launched


def _kernel(op, interface, dtype, aligned=True):
    return KERNELS[interface]["tilelang"](op.call_spec(interface, CUDA, dtype, aligned))


def test_a_gated_backward_kernel_passes_dy_gate_up_then_two_outputs_like_dy(launches):
    kernel = _kernel(SwiGLUBwdOp(), GatedBwdInterface, torch.bfloat16)
    dy, gate, up = (torch.zeros(4096, dtype=torch.bfloat16) for _ in range(3))
    dgate, dup = kernel.forward(dy, gate, up)
    config, rank, tensors = launches[-1]
    assert rank == 1 and tensors[:3] == (dy, gate, up) and tensors[3] is dgate and tensors[4] is dup
    assert dgate.shape == dup.shape == dy.shape and dgate.dtype == torch.bfloat16
    assert config == policy.launch_config(torch.bfloat16, True)


def test_the_in_place_gated_backward_kernel_launches_on_dy_gate_up_alone_and_allocates_nothing(launches):
    kernel = _kernel(SwiGLUInplaceBwdOp(), GatedInplaceBwdInterface, torch.bfloat16)
    dy, gate, up = (torch.zeros(1 << 20, dtype=torch.bfloat16) for _ in range(3))
    assert kernel.forward(dy, gate, up) == ()
    config, rank, tensors = launches[-1]
    assert rank == 1 and len(tensors) == 3 and all(a is b for a, b in zip(tensors, (dy, gate, up)))
    assert config == policy.launch_config(torch.bfloat16, True)


def test_the_in_place_packed_backward_kernel_launches_on_dy_and_x_alone_and_allocates_nothing(launches):
    kernel = _kernel(PackedSwiGLUInplaceBwdOp(1024), PackedGatedInplaceBwdInterface, torch.bfloat16)
    dy, x = torch.zeros(1024, 1024, dtype=torch.bfloat16), torch.zeros(1024, 2048, dtype=torch.bfloat16)
    assert kernel.forward(dy, x) == ()
    config, rank, tensors = launches[-1]
    assert rank == 2 and len(tensors) == 2 and tensors[0] is dy and tensors[1] is x
    assert config == policy.launch_config(torch.bfloat16, True)


def test_a_row_view_kernel_launches_its_own_build_on_the_views_and_writes_contiguous_rows(launches, monkeypatch):
    def gated(width=0, pitches=None):
        op = SwiGLUFwdOp()
        return KERNELS[GatedFwdInterface]["tilelang"](op.call_spec(GatedFwdInterface, CUDA, torch.bfloat16, True, width, pitches))

    kernel = gated(1024, (2048, 2048))
    wide = torch.zeros(6, 2048, dtype=torch.bfloat16)  # [gate | up] rows: each half a row view
    gate, up = wide[:, :1024], wide[:, 1024:]
    y = kernel.forward(gate, up)
    config, rank, tensors = launches[-1]
    assert rank == 2 and tensors[0] is gate and tensors[1] is up and tensors[2] is y
    assert y.shape == (6, 1024) and y.is_contiguous()
    # A build per width and pitches; the contiguous call's kernel is another.
    identities = {gated().identity(), kernel.identity(), gated(1024, (2048, 3072)).identity(), gated(512, (2048, 2048)).identity()}
    assert len(identities) == 4
    compiled = []
    monkeypatch.setattr(programs, "compile_program", lambda *args, **config: compiled.append(config))
    kernel.compile(config, 2)
    gated().compile(config, 1)
    assert compiled == [{"d": 1024, "pitches": (2048, 2048), **config}, {"d": 0, **config}]


def test_calls_of_every_size_take_the_one_build_and_unaligned_kernels_the_scalar_programs(launches):
    kernel = _kernel(SwiGLUBwdOp(), GatedBwdInterface, torch.float16, aligned=False)
    for elements in (1, 5000, 1 << 22):
        kernel.forward(*(torch.zeros(elements, dtype=torch.float16) for _ in range(3)))
        assert launches[-1][0] == {"vec": 1, "threads": 128, "per_thread": 1}


def test_a_tune_request_keeps_the_fastest_candidate_for_later_kernels_of_the_same_identity(launches, monkeypatch, tmp_path):
    import json

    fastest = {"threads": 256, "per_thread": 2}
    tuning_timed_by_config(monkeypatch, tmp_path, launches, fastest)
    kernel = _kernel(SiLUFwdOp(), ActivationFwdInterface, torch.bfloat16)
    kernel.request_tune()
    kernel.forward(torch.zeros(4096, dtype=torch.bfloat16))
    chosen = {**policy.launch_config(torch.bfloat16, True), **fastest}
    assert launches[-1][0] == chosen and kernel.config == chosen  # the call itself ran what tuning chose
    stored = json.loads((tmp_path / "tuning" / "GPU.json").read_text())
    assert stored == {kernel._tuning_key: chosen}
    again = _kernel(SiLUFwdOp(), ActivationFwdInterface, torch.bfloat16)
    again.forward(torch.zeros(8192, dtype=torch.bfloat16))
    assert launches[-1][0] == chosen  # a later kernel of the same identity starts with it


def test_the_packed_kernels_allocate_half_rows_forward_and_x_shaped_gradients(launches):
    op = PackedSwiGLUFwdOp(1024)
    kernel = _kernel(op, PackedGatedFwdInterface, torch.bfloat16)
    x = torch.zeros(3, 2048, dtype=torch.bfloat16)
    y = kernel.forward(x)
    assert y.shape == (3, 1024) and y.dtype == torch.bfloat16 and launches[-1][2] == (x, y) and launches[-1][1] == 2
    backward = KERNELS[PackedGatedBwdInterface]["tilelang"](
        PackedSwiGLUBwdOp(1024).call_spec(PackedGatedBwdInterface, CUDA, torch.bfloat16, True)
    )
    dy = torch.zeros(3, 1024, dtype=torch.bfloat16)
    dx = backward.forward(dy, x)
    assert dx.shape == x.shape and launches[-1][2][:2] == (dy, x) and launches[-1][2][2] is dx


def test_a_program_of_every_kind_is_built_for_every_activation_without_compiling():
    pytest.importorskip("tilelang")
    for kind in programs.KINDS:
        for activation in ("silu", "gelu", "gelu_tanh"):
            for vec in (1, 8):
                programs.make_program(kind, activation, torch.bfloat16, vec=vec, threads=128, per_thread=2, d=1024)
    with pytest.raises(ValueError, match="multiple of vec=8"):
        programs.make_program("packed", "silu", torch.bfloat16, vec=8, threads=128, per_thread=1, d=1001)
    # Row views: one pitch per tensor read, each a whole number of accesses and at least a row.
    for kind, reads in programs.ROW_VIEW_READS.items():
        for vec in (1, 8):
            pitches = (2048,) * reads
            programs.make_program(kind, "silu", torch.bfloat16, vec=vec, threads=128, per_thread=2, d=1024, pitches=pitches)
    for kind, pitches in (("gated", (2048,)), ("act", (1000,)), ("act", (2052,)), ("gated_bwd_inplace", (2048,) * 3)):
        with pytest.raises(ValueError, match="pitches="):
            programs.make_program(kind, "silu", torch.bfloat16, vec=8, threads=128, per_thread=1, d=1024, pitches=pitches)
    with pytest.raises(ValueError, match="unknown activation"):
        programs.make_program("act", "relu", torch.bfloat16, vec=8, threads=128, per_thread=1)


# -- the compile tier ---------------------------------------------------------------------------

COMPILE = """
import torch
from tileops.kernels.cuda.activation import policy, programs
target = {"kind": "cuda", "arch": "sm_90"}
# One build per kind: each activation, each dtype, vector and scalar accesses, the rule's launch
# shape and a tuning candidate's several accesses a thread.
several = {"threads": 256, "per_thread": 4}
for kind, activation, dtype, aligned, d, config in [
    ("act", "silu", torch.bfloat16, True, 0, {}),
    ("act_bwd", "gelu", torch.float16, True, 0, several),
    ("gated", "gelu_tanh", torch.float32, True, 0, {}),
    ("gated_bwd", "silu", torch.bfloat16, False, 0, {}),
    ("gated_bwd_inplace", "silu", torch.bfloat16, True, 0, several),
    ("packed", "silu", torch.bfloat16, True, 14336, {}),
    ("packed_bwd", "gelu", torch.float32, False, 1001, several),
    ("packed_bwd_inplace", "silu", torch.bfloat16, True, 4096, {}),
    # Row views (the halves of a fused gate-up projection): rows of d at their pitches.
    ("gated_bwd", "silu", torch.bfloat16, True, 11008, {"pitches": (11008, 22016, 22016)}),
]:
    config = {**policy.launch_config(dtype, aligned), **config}
    kernel = programs.compile_program(kind, activation, dtype, target, d=d, **config)
    source = kernel.get_kernel_source()
    body = source[source.index("__launch_bounds__"):]
    accesses = (body.count("(uint4*)") + body.count("(float4*)")) // 2  # each access casts both sides
    pitched = ["pitch", str(config["pitches"][1]) in body] if "pitches" in config else []
    print(kind, config["vec"], accesses, "erff" in body, "tanhf" in body, "exp2f" in body, *pitched)
"""


@pytest.mark.compile
def test_one_build_per_kind_compiles_for_sm90_with_16_byte_accesses_where_aligned(tmp_path):
    result = run_python(COMPILE, env={"TILELANG_CACHE_DIR": str(tmp_path)})
    assert result.returncode == 0, result.stderr[-4000:]
    lines = [line.split() for line in result.stdout.splitlines() if line.split()[0] in programs.KINDS]
    # kind, vec, 16-byte accesses (one per tensor the program reads or writes), erf, tanh, and
    # the exp2 that silu's sigmoid is computed with
    assert lines == [
        ["act", "8", "2", "False", "False", "True"],
        ["act_bwd", "8", "3", "True", "False", "False"],
        ["gated", "4", "3", "False", "True", "False"],
        ["gated_bwd", "1", "0", "False", "False", "True"],
        ["gated_bwd_inplace", "8", "5", "False", "False", "True"],  # dy, gate, up read; gate, up written
        ["packed", "8", "3", "False", "False", "True"],
        ["packed_bwd", "1", "0", "True", "False", "False"],
        ["packed_bwd_inplace", "8", "5", "False", "False", "True"],  # dy, gate, up read; dgate, dup written over x
        ["gated_bwd", "8", "5", "False", "False", "True", "pitch", "True"],  # gate and up read 22016 apart
    ], result.stdout[-3000:]
