"""Fault injection on the call path: bad tensors and buffers from a caller, faulty kernels,
builders, refusals and device-facts readers from a backend, and compiled code.

Each case breaks one thing on purpose and asserts three facts: the error's type, that its
message names the culprit (the argument, or the target / key / reader that produced it), and
that the op still works afterwards. To add a case, write the fault and call ``assert_refused``
(or assert on the error yourself) followed by ``assert_still_works``.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
import warnings

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F

from tileops.backend import (
    BackendError,
    CallSpec,
    Kernel,
    OpArgumentError,
    register_device_facts,
    register_kernel_builder,
    register_kernel_type,
    set_default_target,
)
from tileops.core import registry
from tileops.core.device_facts import facts_for
from tileops.core.manifest.overlap import overlapping
from tileops.ops import FusedAddRMSNormFwdOp, RMSNormFwdOp
from tileops.ops.norm.interfaces import RMSNormFwdInterface

N = 64


def assert_refused(error_type, call, *culprits: str):
    """``call()`` raises ``error_type`` whose message names every one of ``culprits``."""
    with pytest.raises(error_type) as raised:
        call()
    message = str(raised.value)
    for culprit in culprits:
        assert culprit in message, f"{culprit!r} not named in: {message}"
    return raised.value


def assert_still_works(op, *inputs):
    """The op gives torch's answer after the fault (an RMSNorm op without weight)."""
    x = inputs[0] if inputs else torch.randn(3, N)
    got = op(x, *inputs[1:])
    want = F.rms_norm(x, (x.shape[-1],), *inputs[1:2], eps=torch.finfo(x.dtype).eps)
    torch.testing.assert_close(got, want)


# -- output buffers that share memory ----------------------------------------------------------


def test_the_same_buffer_as_out_and_residual_out_is_refused_naming_both():
    op = FusedAddRMSNormFwdOp(N)
    x, r, buf = torch.randn(4, N), torch.randn(4, N), torch.empty(4, N)
    assert_refused(OpArgumentError, lambda: op(x, r, out=buf, residual_out=buf), "'out'", "'residual_out'", "share memory")
    y, s = op(x, r, out=buf, residual_out=torch.empty(4, N))
    assert y is buf
    torch.testing.assert_close(s, x + r)


def test_overlapping_views_as_output_buffers_are_refused():
    op = FusedAddRMSNormFwdOp(N)
    x, r, big = torch.randn(4, N), torch.randn(4, N), torch.empty(5, N)
    assert_refused(OpArgumentError, lambda: op(x, r, out=big[:4], residual_out=big[1:]), "'out'", "'residual_out'")
    y, s = op(x, r, out=big[:4], residual_out=torch.empty(8, N)[4:])  # disjoint: accepted
    torch.testing.assert_close(y, F.rms_norm(x + r, (N,), eps=torch.finfo(x.dtype).eps))


def test_disjoint_views_of_one_storage_are_accepted_as_output_buffers():
    op = FusedAddRMSNormFwdOp(N)
    x, r, big = torch.randn(4, N), torch.randn(4, N), torch.empty(8, N)
    y, s = op(x, r, out=big[:4], residual_out=big[4:])
    assert y.data_ptr() == big.data_ptr()
    torch.testing.assert_close(big[4:], x + r)


def _bytes_of(view: torch.Tensor) -> set[int]:
    """Every byte address ``view`` touches, by enumerating its elements."""
    size, base = view.element_size(), view.data_ptr()
    addresses: set[int] = set()
    for index in itertools.product(*(range(n) for n in view.shape)):
        start = base + sum(i * s for i, s in zip(index, view.stride())) * size
        addresses.update(range(start, start + size))
    return addresses


def _random_view(base: torch.Tensor, rng: random.Random, steps=(1, 1, 2, 3)) -> torch.Tensor:
    """A slice of ``base`` in every dimension (start, length, step), sometimes permuted."""
    view = base
    for dim in range(view.dim()):
        start = rng.randrange(view.shape[dim])
        view = view.narrow(dim, start, rng.randint(1, view.shape[dim] - start))
        view = view[(slice(None),) * dim + (slice(None, None, rng.choice(steps)),)]
    if view.dim() > 1 and rng.random() < 0.3:
        order = list(range(view.dim()))
        rng.shuffle(order)
        view = view.permute(order)
    return view


def test_the_overlap_rule_never_misses_a_shared_element_and_is_exact_for_views_of_the_same_strides():
    """Against the byte sets of 2000 random pairs of views of one storage: a pair that shares an
    element is always caught; a pair of the same strides (q and k slices of a fused qkv tensor,
    t[::2] and t[1::2]) is refused exactly when it shares one."""
    rng = random.Random(0)
    exact = 0
    for _ in range(2000):
        base = torch.empty([rng.randint(1, 6) for _ in range(rng.randint(1, 4))])
        if rng.random() < 0.5:
            a, b = _random_view(base, rng), _random_view(base, rng)
        else:  # slices along one dimension, with one step: the same strides
            dim, step = rng.randrange(base.dim()), rng.choice((1, 2))
            a, b = (
                base.narrow(dim, start, rng.randint(1, base.shape[dim] - start))[(slice(None),) * dim + (slice(None, None, step),)]
                for start in (rng.randrange(base.shape[dim]), rng.randrange(base.shape[dim]))
            )
        shared = bool(_bytes_of(a) & _bytes_of(b))
        refused = overlapping([("a", a)], [("b", b)]) is not None
        assert refused or not shared, (a.shape, a.stride(), b.shape, b.stride())
        if a.stride() == b.stride() and a.dim() == b.dim():
            assert refused == shared, (a.shape, a.stride(), b.shape, b.stride())
            exact += 1
    assert exact > 500  # the exact comparison was exercised, not only the conservative one


def test_an_out_buffer_that_overlaps_an_input_is_refused_naming_both():
    op = RMSNormFwdOp(N)
    x = torch.randn(4, N)
    assert_refused(OpArgumentError, lambda: op(x, out=x), "output buffer 'out'", "argument 'x'")
    assert_refused(OpArgumentError, lambda: op(x[1:], out=x[:3]), "output buffer 'out'", "argument 'x'")
    weight = torch.randn(5 * N)
    out = weight[N:].view(4, N)
    assert_refused(OpArgumentError, lambda: op(x, weight[N : 2 * N], out=out), "output buffer 'out'", "argument 'weight'")
    assert_still_works(op)


def test_an_out_buffer_overlapping_a_non_contiguous_input_is_accepted_because_the_input_is_copied():
    op = RMSNormFwdOp(N)
    base = torch.randn(N, 4)
    x = base.t()  # (4, N), not contiguous: the op reads a contiguous copy
    out = torch.empty(4, N)
    torch.testing.assert_close(op(x, out=out), F.rms_norm(x, (N,), eps=torch.finfo(x.dtype).eps))


# -- tensor kinds no op takes --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "kind"),
    [
        (lambda x: x.to_sparse(), "sparse_coo"),
        (lambda x: x.to_sparse_csr(), "sparse_csr"),
        (lambda x: torch.nested.nested_tensor([x[:2], x[2:]]), "nested"),
        pytest.param(
            lambda x: x.to_mkldnn(),
            "mkldnn",
            # An mkldnn tensor answers is_contiguous() with True: the generated path checks its layout.
            marks=pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs torch built with mkldnn"),
        ),
    ],
    ids=["sparse-coo", "sparse-csr", "nested", "mkldnn"],
)
def test_tensors_of_unsupported_kinds_are_refused_by_name(make, kind):
    op = RMSNormFwdOp(N)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns that these layouts are in beta
        x = make(torch.randn(4, N))
    assert_refused(OpArgumentError, lambda: op(x), "RMSNormFwdOp", "argument 'x'", kind)
    assert_refused(OpArgumentError, lambda: op(torch.randn(4, N), out=x), "output buffer 'out'", kind)
    assert_still_works(op)


def test_a_tensor_under_vmap_is_refused_by_name():
    op = RMSNormFwdOp(N)
    assert_refused(OpArgumentError, lambda: torch.vmap(op)(torch.randn(3, 4, N)), "argument 'x'", "torch.vmap")
    assert_still_works(op)


# -- results a target's kernel gets wrong --------------------------------------------------------


def _builder(kernel):
    def build(x, weight, *, normalized_shape, eps):
        return kernel

    return build


def _right(x, weight=None, *, out=None):
    y = F.rms_norm(x, (x.shape[-1],), weight, eps=torch.finfo(x.dtype).eps)
    return y if out is None else out.copy_(y)


FAULTY_KERNELS = {
    "a meta tensor for a CPU call": (lambda x, weight=None, *, out=None: torch.empty(x.shape, device="meta"), False),
    "a new tensor instead of the out= buffer": (lambda x, weight=None, *, out=None: _right(x, weight), True),
    "float64 with out= given": (lambda x, weight=None, *, out=None: _right(x.double(), weight), True),
    "a wrong-device result with out= given": (lambda x, weight=None, *, out=None: torch.empty(x.shape, device="meta"), True),
    "a tuple for a single output": (lambda x, weight=None, *, out=None: (_right(x, weight),), False),
}


@pytest.mark.parametrize("fault", list(FAULTY_KERNELS))
def test_a_target_kernel_result_that_does_not_fit_is_an_error_naming_the_target(scoped_registry, fault):
    kernel, with_out = FAULTY_KERNELS[fault]
    register_kernel_builder(op="RMSNormFwdOp", target="faulty", build_kernel=_builder(kernel))
    op = RMSNormFwdOp(N, target="faulty")
    x = torch.randn(4, N)
    out = torch.full((4, N), 7.0) if with_out else None
    kwargs = {"out": out} if with_out else {}
    assert_refused(OpArgumentError, lambda: op(x, **kwargs), "RMSNormFwdOp", "target 'faulty'", "'y'")
    if with_out and fault == "a new tensor instead of the out= buffer":
        assert "out=" in str(assert_refused(OpArgumentError, lambda: op(x, **kwargs)))
    # The same op class still works, bound to the in-tree implementations.
    assert_still_works(RMSNormFwdOp(N, target="builtin"))


def test_a_target_kernel_that_fills_and_returns_the_buffer_is_accepted(scoped_registry):
    register_kernel_builder(op="RMSNormFwdOp", target="faithful", build_kernel=_builder(_right))
    op = RMSNormFwdOp(N, target="faithful")
    x, out = torch.randn(4, N), torch.empty(4, N)
    assert op(x, out=out) is out
    assert_still_works(op)


# -- faulty backend code: builders, refusals, identities, device facts ----------------------------


def test_a_builder_with_the_wrong_signature_is_an_error_naming_the_target(scoped_registry):
    register_kernel_builder(op="RMSNormFwdOp", target="wrongsig", build_kernel=lambda x, weight: _right)
    op = RMSNormFwdOp(N, target="wrongsig")
    assert_refused(BackendError, lambda: op(torch.randn(4, N)), "target 'wrongsig'", "normalized_shape")
    assert_still_works(RMSNormFwdOp(N))


@dataclasses.dataclass(frozen=True)
class _Probe:
    """What a faulty implementation does: which of its methods raises or misbehaves."""

    refusal_raises: bool = False
    identity_unhashable: bool = False
    entry_for_raises: bool = False


def _faulty_kernel_type(probe: _Probe):
    others = {"torch_cpu", *registry.kernel_types("RMSNormFwdOp")}  # an installed backend's keys too

    class FaultyRMSNorm(Kernel, RMSNormFwdInterface):
        devices = frozenset({"cpu"})
        preferred_over = frozenset(others)

        @classmethod
        def refusal(cls, call: CallSpec):
            if probe.refusal_raises:
                raise ZeroDivisionError("refusal broke")
            return None

        @classmethod
        def entry_for(cls, call):
            if probe.entry_for_raises:
                raise KeyError("no build for this row length")
            return ([1, 2] if probe.identity_unhashable else None), cls

        def forward(self, x, weight):
            return _right(x, weight)

    return FaultyRMSNorm


@pytest.mark.parametrize(
    ("probe", "error_text"),
    [
        (_Probe(refusal_raises=True), "refusal() of implementation 'faulty'"),
        (_Probe(identity_unhashable=True), "identity"),
        (_Probe(entry_for_raises=True), "entry_for raised KeyError"),
    ],
    ids=["refusal-raises", "unhashable-identity", "entry-for-raises"],
)
def test_a_faulty_implementation_is_an_error_naming_its_key(scoped_registry, probe, error_text):
    register_kernel_type(op="RMSNormFwdOp", key="faulty", kernel_type=_faulty_kernel_type(probe))
    op = RMSNormFwdOp(N)
    error = assert_refused(BackendError, lambda: op(torch.randn(4, N)), "RMSNormFwdOp", "'faulty'", error_text)
    assert "FaultyRMSNorm" in str(error)
    # The op retries on the next call (nothing half-built was cached), and fails the same way.
    assert_refused(BackendError, lambda: op(torch.randn(4, N)), "'faulty'")


def test_a_raising_device_facts_reader_is_an_error_naming_the_reader(scoped_registry):
    def broken_reader(device):
        raise OSError("no driver")

    register_device_facts("faultydev", broken_reader)
    error = assert_refused(BackendError, lambda: facts_for(_FakeDevice()), "faultydev", "broken_reader", "OSError")
    assert "no driver" in str(error)
    assert facts_for(torch.device("cpu")).device_type == "cpu"


def test_a_kernel_the_compiler_rejects_is_an_error_naming_the_kernel_the_architecture_and_the_complaint(monkeypatch):
    # As a CUDA toolkit that does not build for the GPU's architecture fails (CUDA 13 for sm_70).
    from tileops.core import KernelBuildError
    from tileops.kernels.cuda import compile as compiling

    class _Program:
        def with_attr(self, name, value):
            return self

    class _RejectingTileLang:
        calls = 0

        def compile(self, program, target, **options):
            type(self).calls += 1
            raise RuntimeError("Compilation error:\nnvcc fatal   : Unsupported gpu architecture 'sm_70'\n\nCommand: nvcc ...")

    monkeypatch.setattr(compiling, "_import_tilelang", _RejectingTileLang)
    identity = ("fault", "rejected", 4096, (("threads", 256),))
    error = assert_refused(
        KernelBuildError, lambda: compiling.compile_once(identity, _Program, {"kind": "cuda", "arch": "sm_70"}),
        "fault rejected 4096 threads=256", "cuda sm_70", "nvcc fatal   : Unsupported gpu architecture 'sm_70'",
        "must build for the GPU's architecture",
    )
    assert isinstance(error, RuntimeError) and "Compilation error" not in str(error)
    assert "Command:" in str(error.__cause__)  # the compiler's whole output stays reachable
    # Nothing is kept of the failure: the next call compiles again.
    with pytest.raises(KernelBuildError):
        compiling.compile_once(identity, _Program, {"kind": "cuda", "arch": "sm_70"})
    assert _RejectingTileLang.calls == 2


class _FakeDevice:
    """A device of a type torch does not know, as selection would hand it to a reader."""

    type = "faultydev"
    index = 0

    def __hash__(self):
        return hash((self.type, self.index))

    def __eq__(self, other):
        return isinstance(other, _FakeDevice)

    def __str__(self):
        return "faultydev:0"


# -- compiled code ---------------------------------------------------------------------------------


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize(
    ("make_out", "culprit"),
    [
        (lambda: torch.empty(4, N - 1), "expected shape"),
        (lambda: torch.empty(4, N, dtype=torch.float64), "float64"),
        (lambda: torch.empty(N, 4).t(), "must be contiguous"),
        (lambda: torch.empty(4, N, device="meta"), "is on meta"),
    ],
    ids=["shape", "dtype", "non-contiguous", "meta"],
)
def test_compiled_code_checks_out_buffers_exactly_as_eager_code(fresh_dynamo, make_out, culprit):
    op = RMSNormFwdOp(N)
    x = torch.randn(4, N)
    compiled = torch.compile(lambda x, out: op(x, out=out), fullgraph=True, backend="eager")
    eager = assert_refused(OpArgumentError, lambda: op(x, out=make_out()), "output buffer 'out'", culprit)
    traced = assert_refused(OpArgumentError, lambda: compiled(x, make_out()), "output buffer 'out'", culprit)
    assert str(traced) == str(eager)
    out = torch.empty(4, N)
    assert compiled(x, out) is out
    torch.testing.assert_close(out, op(x))


def test_compiled_code_refuses_output_buffers_that_share_memory(fresh_dynamo):
    op = FusedAddRMSNormFwdOp(N)
    x, r, buf = torch.randn(4, N), torch.randn(4, N), torch.empty(4, N)
    compiled = torch.compile(lambda x, r, a, b: op(x, r, out=a, residual_out=b), fullgraph=True, backend="eager")
    assert_refused(OpArgumentError, lambda: compiled(x, r, buf, buf), "'out'", "'residual_out'", "share memory")
    y, s = compiled(x, r, buf, torch.empty(4, N))
    assert y is buf
    torch.testing.assert_close(s, x + r)


def test_each_instance_keeps_its_own_target_in_compiled_code(scoped_registry, fresh_dynamo):
    ran = []

    def marker(x, weight=None, *, out=None):
        ran.append("marker")
        return _right(x, weight, out=out)

    register_kernel_builder(op="RMSNormFwdOp", target="marker", build_kernel=_builder(marker))
    first = RMSNormFwdOp(N)
    x = torch.randn(4, N)
    first(x)  # binds the in-tree implementations
    set_default_target("marker")
    try:
        second = RMSNormFwdOp(N)  # equal params, bound to 'marker' on its first call
        compiled_second = torch.compile(lambda x: second(x), fullgraph=True, backend="eager")
        compiled_first = torch.compile(lambda x: first(x), fullgraph=True, backend="eager")
        compiled_first(x)
        assert ran == []
        compiled_second(x)
        assert ran == ["marker"] and second.target == "marker" and first.target == "builtin"
        second(x)
        assert ran == ["marker", "marker"]
    finally:
        set_default_target(None)
    assert_still_works(RMSNormFwdOp(N))


def test_an_op_constructed_inside_a_compiled_function_is_a_clear_error(fresh_dynamo):
    compiled = torch.compile(lambda x: RMSNormFwdOp(N)(x), fullgraph=True, backend="eager")
    assert_refused(Exception, lambda: compiled(torch.randn(4, N)), "RMSNormFwdOp", "construct it outside")
    # Without fullgraph the construction runs eagerly and the call works.
    x = torch.randn(4, N)
    torch.testing.assert_close(torch.compile(lambda x: RMSNormFwdOp(N)(x), backend="eager")(x), RMSNormFwdOp(N)(x))


def test_too_many_positional_arguments_in_compiled_code_are_a_clear_error(fresh_dynamo):
    op = RMSNormFwdOp(N)
    x = torch.randn(4, N)
    compiled = torch.compile(lambda *args: op(*args), fullgraph=True, backend="eager")
    assert_refused(Exception, lambda: compiled(x, torch.randn(N), torch.randn(N)), "RMSNormFwdOp", "at most 2 positional")
    assert_still_works(op)


def test_a_target_kernel_returning_a_view_of_its_input_is_copied_out_of_compiled_code(scoped_registry, fresh_dynamo):
    register_kernel_builder(
        op="RMSNormFwdOp", target="viewing", build_kernel=_builder(lambda x, weight=None, *, out=None: x.view(x.shape))
    )
    op = RMSNormFwdOp(N, target="viewing")
    x = torch.randn(4, N)
    got = torch.compile(lambda x: op(x), fullgraph=True, backend="aot_eager")(x)
    assert torch.equal(got, x) and got.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
    assert_still_works(RMSNormFwdOp(N))


# -- a registered kernel type's result delivered into out= ------------------------------------


@pytest.mark.parametrize(
    ("wrong", "shown"),
    [(lambda y: y.double(), "torch.float64"), (lambda y: y.to("meta"), "on meta")],
    ids=["float64", "meta"],
)
def test_a_kernel_types_result_of_another_dtype_or_device_is_not_copied_into_out(scoped_registry, wrong, shown):
    class _Wrong(Kernel, RMSNormFwdInterface):
        devices = frozenset({"cpu"})
        preferred_over = frozenset({"torch_cpu", "acme_short_rows"})

        @classmethod
        def entry_for(cls, call):
            return call.n, cls

        def forward(self, x, weight):
            return wrong(F.rms_norm(x, (x.shape[-1],), weight))

    register_kernel_type("RMSNormFwdOp", "wrong_result", _Wrong)
    op = RMSNormFwdOp(N)
    x, out = torch.randn(3, N), torch.full((3, N), 7.0)
    assert_refused(OpArgumentError, lambda: op(x, out=out), "RMSNormFwdOp", "'y'", shown)
    assert torch.equal(out, torch.full((3, N), 7.0))  # the caller's buffer is not written with a cast
    y, total = FusedAddRMSNormFwdOp(N)(x, x)  # other ops are untouched by the faulty kernel type
    torch.testing.assert_close(total, x + x)
