"""The conformance kit run against a deliberately broken backend: it must report every fault.

Each test registers, inside ``scoped_registry`` and on CPU tensors, a small target (or an
added kernel type) with exactly one fault, runs the kit's checks for it, and asserts which
checks fail, each with a message that names the fault, while every other check passes. The
kits are built with ``max_elements=1 << 16``, which keeps only the ``decode-1`` workloads
(one row of 4096), so each check runs in milliseconds.

Two faults the kit cannot see are kept as strict xfails, each with a minimal example: a
kernel that recompiles itself on every call without going through the registered builder,
and a backend module that calls its builder function directly at import.
"""

from __future__ import annotations

import ast
import importlib
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import ClassVar

import pytest
import torch
import torch.nn.functional as F

from tileops.backend import (
    Kernel,
    OpArgumentError,
    TensorSpec,
    register_kernel_builder,
    register_kernel_type,
)
from tileops.core import Op
from tileops.ops import (
    FAMILIES,
    FusedAddLayerNormFwdOp,
    FusedAddRMSNormFwdOp,
    LayerNormFwdOp,
    LinearCrossEntropyBwdOp,
    RMSNormFwdOp,
)
from tileops.ops.norm import RMSNormCall, RMSNormFwdInterface
from tileops.testing import Check, KernelTypeConformance, TargetConformance
from tileops_acme import builders as acme_builders
from tileops_acme.kernels import AcmeFusedAddRMSNorm, AcmeRMSNorm

SMALL_WORKLOADS = 1 << 16  # keeps each op's decode-1 workload (8 to 16 Ki elements), drops the rest
DECODE_DTYPES = ("bfloat16", "float16", "float32")  # the dtypes of every norm op's decode-1 workload
NORM_OPS: tuple[type[Op], ...] = (RMSNormFwdOp, LayerNormFwdOp, FusedAddRMSNormFwdOp, FusedAddLayerNormFwdOp)
#: The norm family's backward ops, which the template's builders do not serve.
BACKWARD_OPS: tuple[type[Op], ...] = tuple(op.backward_class() for op in NORM_OPS)
#: The other families' ops, which the norm targets below do not serve.
OTHER_FAMILY_OPS: tuple[type[Op], ...] = tuple(op for name, ops in FAMILIES.items() if name != "norm" for op in ops)
ACME_BUILDERS = {
    RMSNormFwdOp: acme_builders.build_rms_norm,
    LayerNormFwdOp: acme_builders.build_layer_norm,
    FusedAddRMSNormFwdOp: acme_builders.build_fused_add_rms_norm,
    FusedAddLayerNormFwdOp: acme_builders.build_fused_add_layer_norm,
}
CPU = torch.device("cpu")


# -- running the kit ---------------------------------------------------------------------------
def run_checks(checks: Iterable[Check]) -> dict[str, Exception | None]:
    """Run every check: its name -> what it raised, or None when it passed."""
    outcomes: dict[str, Exception | None] = {}
    for check in checks:
        try:
            check()
        except Exception as error:  # noqa: BLE001 - the kit's AssertionError, or an error the op raised first
            outcomes[check.name] = error
        else:
            outcomes[check.name] = None
    return outcomes


def failures(outcomes: dict[str, Exception | None]) -> dict[str, Exception]:
    return {name: error for name, error in outcomes.items() if error is not None}


def named(checks: Iterable[Check], name: str) -> Check:
    """The one check called ``name``."""
    matching = [check for check in checks if check.name == name]
    assert len(matching) == 1, f"expected one check named {name!r}, found {len(matching)}"
    return matching[0]


def workload_check(target: str, op: type[Op], dtype: str) -> str:
    return f"{target}: {op.__name__} decode-1 {dtype}"


def empty_write_check(target: str, op: type[Op]) -> str:
    return f"{target}: {op.__name__} empty-write call"


def build_count_check(target: str, op: type[Op]) -> str:
    return f"{target}: {op.__name__} builds once per input layout"


def not_served_check(target: str, op: type[Op]) -> str:
    """The check of an op the target does not serve: one that holds kernels of its own says so;
    one without (its torch code is all it computes with) runs it."""
    if not op.kernel_interfaces:
        return f"{target}: {op.__name__} holds no kernels and runs its own torch code"
    return f"{target}: {op.__name__} is not served and says so"


def small_kit(target: str) -> TargetConformance:
    return TargetConformance(target, device="cpu", max_elements=SMALL_WORKLOADS)


# -- a backend with one fault at a time ------------------------------------------------------------
def builder_of(kernel_class: type) -> Callable:
    """A kernel builder, for any norm op, whose kernels are ``kernel_class`` instances."""

    def build_kernel(x: TensorSpec, *other_inputs: TensorSpec | None, normalized_shape, eps):
        return kernel_class(normalized_shape, eps, x.dtype)

    return build_kernel


def register_target(target: str, op: type[Op], kernel_class: type) -> None:
    register_kernel_builder(op=op.__name__, target=target, build_kernel=builder_of(kernel_class))


class OffByOnePercent(AcmeRMSNorm):
    """Wrong values: every output is 1% too large."""

    def __call__(self, x, weight, *, out=None):
        return super().__call__(x, weight, out=out).mul_(1.01)


class ForgetsTheWeight(AcmeRMSNorm):
    """Wrong values: normalizes, but never scales by the weight."""

    def __call__(self, x, weight, *, out=None):
        return super().__call__(x, None, out=out)


class ForgetsToCastBack(AcmeRMSNorm):
    """Wrong dtype: returns its float32 accumulator (an out= buffer still casts it)."""

    def __call__(self, x, weight, *, out=None):
        y = F.rms_norm(x.float(), self.normalized_shape, None if weight is None else weight.float(), self.eps)
        return y if out is None else out.copy_(y)


class ReturnsFlatRows(AcmeRMSNorm):
    """Wrong shape: returns its result flattened to one dimension."""

    def __call__(self, x, weight, *, out=None):
        y = super().__call__(x, weight).flatten()
        return y if out is None else out.copy_(y.view_as(out))


class IgnoresOutBuffer(AcmeRMSNorm):
    """Ignores out=: returns a new tensor and leaves the caller's buffer unwritten."""

    def __call__(self, x, weight, *, out=None):
        return super().__call__(x, weight)


class IgnoresResidualOutBuffer(AcmeFusedAddRMSNorm):
    """Ignores residual_out=: fills out= but returns the residual sum as a new tensor."""

    def __call__(self, x, residual, weight, *, out=None, residual_out=None):
        return super().__call__(x, residual, weight, out=out)


# -- a correct target --------------------------------------------------------------------------------
def test_a_correct_target_passes_every_check(scoped_registry):
    for op, build_kernel in ACME_BUILDERS.items():
        register_kernel_builder(op=op.__name__, target="sound", build_kernel=build_kernel)

    outcomes = run_checks(small_kit("sound").checks())

    expected_names = {workload_check("sound", op, dtype) for op in NORM_OPS for dtype in DECODE_DTYPES}
    expected_names |= {empty_write_check("sound", op) for op in NORM_OPS}
    expected_names |= {build_count_check("sound", op) for op in NORM_OPS}
    expected_names |= {not_served_check("sound", op) for op in (*BACKWARD_OPS, *OTHER_FAMILY_OPS)}
    assert set(outcomes) == expected_names
    assert failures(outcomes) == {}


# -- wrong values ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kernel_class", "failing_dtypes"),
    [
        # 1% stays within bfloat16's tolerance (atol = rtol = 1.6e-2), so its check passes; the
        # build count check runs bfloat16 too and passes. float16 (2e-3) and float32 (1e-5) fail.
        (OffByOnePercent, ("float16", "float32")),
        (ForgetsTheWeight, DECODE_DTYPES),
    ],
    ids=lambda value: getattr(value, "__name__", None),
)
def test_wrong_values_fail_the_workload_checks(scoped_registry, kernel_class, failing_dtypes):
    register_target("wrong_values", RMSNormFwdOp, kernel_class)

    failed = failures(run_checks(small_kit("wrong_values").checks()))

    expected = {workload_check("wrong_values", RMSNormFwdOp, dtype) for dtype in failing_dtypes}
    if "bfloat16" in failing_dtypes:  # the build count check compares bfloat16 values as well
        expected.add(build_count_check("wrong_values", RMSNormFwdOp))
    assert set(failed) == expected
    for error in failed.values():
        assert isinstance(error, AssertionError)
        assert "RMSNormFwdOp on workload 'decode-1'" in str(error)
        assert "output 'y': Tensor-likes are not close" in str(error)


# -- wrong output dtype or shape ---------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kernel_class", "failing_dtypes", "problem"),
    [
        (ForgetsToCastBack, ("bfloat16", "float16"), "returned output 'y' as (1, 4096) torch.float32"),
        (ReturnsFlatRows, DECODE_DTYPES, "returned output 'y' as (4096,)"),
    ],
    ids=lambda value: getattr(value, "__name__", None),
)
def test_a_wrong_output_dtype_or_shape_fails_the_workload_checks(scoped_registry, kernel_class, failing_dtypes, problem):
    register_target("wrong_layout", RMSNormFwdOp, kernel_class)

    failed = failures(run_checks(small_kit("wrong_layout").checks()))

    # The build count check runs bfloat16, the first decode-1 dtype, which both faults break.
    expected = {workload_check("wrong_layout", RMSNormFwdOp, dtype) for dtype in failing_dtypes}
    expected.add(build_count_check("wrong_layout", RMSNormFwdOp))
    assert set(failed) == expected
    for error in failed.values():
        # The op's own result check raises before the kit compares anything: the check fails
        # with OpArgumentError, not AssertionError, naming the target and the bad output.
        assert isinstance(error, OpArgumentError)
        assert "RMSNormFwdOp: target 'wrong_layout'" in str(error)
        assert problem in str(error)


# -- out= buffers ignored ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("op", "kernel_class", "problem"),
    [
        (RMSNormFwdOp, IgnoresOutBuffer, "output 'y' as a new tensor instead of the buffer passed as out="),
        (
            FusedAddRMSNormFwdOp,
            IgnoresResidualOutBuffer,
            "output 'residual_sum' as a new tensor instead of the buffer passed as residual_out=",
        ),
    ],
    ids=lambda value: getattr(value, "__name__", None),
)
def test_an_ignored_out_buffer_fails_the_workload_checks(scoped_registry, op, kernel_class, problem):
    register_target("ignores_out", op, kernel_class)

    failed = failures(run_checks(small_kit("ignores_out").checks()))

    assert set(failed) == {workload_check("ignores_out", op, dtype) for dtype in DECODE_DTYPES}
    for error in failed.values():
        # The op's own result check raises before the kit compares anything, naming the target.
        assert isinstance(error, OpArgumentError)
        assert f"{op.__name__}: target 'ignores_out'" in str(error)
        assert problem in str(error)


# -- kernels built once per input layout ----------------------------------------------------------------
# A backend cannot make the op rebuild through its builder: the op caches each kernel by
# (device, each input's presence, dtype and shape) and calls the registered builder only on a
# miss of that cache. So the count check is tested on a correct builder, checking the count it
# asserts is the real one; a kernel that rebuilds itself behind the op's back is the xfail below.
def test_the_build_count_check_passes_and_counts_one_build_per_layout(scoped_registry):
    built_for: list[TensorSpec] = []

    def recording_builder(x, weight, *, normalized_shape, eps):
        built_for.append(x)
        return AcmeRMSNorm(normalized_shape, eps, x.dtype)

    register_kernel_builder(op="RMSNormFwdOp", target="counted", build_kernel=recording_builder)

    named(small_kit("counted").checks(), build_count_check("counted", RMSNormFwdOp))()

    # Two calls of the (1, 4096) layout, then one of (2, 4096): two builds, one per layout.
    assert built_for == [TensorSpec(CPU, torch.bfloat16, (1, 4096)), TensorSpec(CPU, torch.bfloat16, (2, 4096))]


class RecompilesEveryCall:
    """Builds a fresh kernel inside every call with the backend's own build function, which
    the kit never sees: it only counts the kernels the op built through the registered builder."""

    compilations: ClassVar[list[TensorSpec]] = []

    def __init__(self, normalized_shape, eps, dtype) -> None:
        self.normalized_shape, self.eps = normalized_shape, eps

    def __call__(self, x, weight, *, out=None):
        spec = TensorSpec.of(x)
        RecompilesEveryCall.compilations.append(spec)
        kernel = acme_builders.build_rms_norm(spec, weight, normalized_shape=self.normalized_shape, eps=self.eps)
        return kernel(x, weight, out=out)


@pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="kit gap: the build count check counts the kernels the op built through the registered builder only, so a "
    "kernel that compiles a new kernel on every call (here 3 compilations for 2 layouts) passes it",
)
def test_a_kernel_that_recompiles_on_every_call_fails_the_build_count_check(scoped_registry, monkeypatch):
    monkeypatch.setattr(RecompilesEveryCall, "compilations", [])
    register_target("recompiling", RMSNormFwdOp, RecompilesEveryCall)

    outcome = run_checks([named(small_kit("recompiling").checks(), build_count_check("recompiling", RMSNormFwdOp))])

    if len(RecompilesEveryCall.compilations) != 3:  # pytest.fail is no AssertionError: not the xfail
        pytest.fail(f"the fault did not happen: {len(RecompilesEveryCall.compilations)} compilations")
    error = outcome[build_count_check("recompiling", RMSNormFwdOp)]
    assert isinstance(error, AssertionError), "the kit did not report a kernel compiled on every call"


# -- kernels built at import -----------------------------------------------------------------------------
BACKEND_MODULE = '''"""A one-op backend written by test_conformance_kit: {purpose}."""

import pathlib

import torch
import torch.nn.functional as F

from tileops.backend import TensorSpec, register_kernel_builder
from tileops.ops import RMSNormFwdOp

TARGET = {target!r}
BUILD_LOG = pathlib.Path({build_log!r})


def build_rms_norm(x, weight, *, normalized_shape, eps):
    with BUILD_LOG.open("a") as log:
        log.write(f"{{x.shape}}\\n")

    def kernel(x, weight, *, out=None):
        w = None if weight is None else weight.float()
        y = F.rms_norm(x.float(), normalized_shape, w, eps).to(x.dtype)
        return y if out is None else out.copy_(y)

    return kernel


register_kernel_builder(op="RMSNormFwdOp", target=TARGET, build_kernel=build_rms_norm)
{at_import}
'''

WARMS_UP_THROUGH_THE_OP = "RMSNormFwdOp(8, target=TARGET)(torch.randn(2, 8))  # the fault"
CALLS_ITS_BUILDER = "build_rms_norm(TensorSpec(torch.device('cpu'), torch.float32, (2, 8)), None, normalized_shape=(8,), eps=None)  # the fault"


class BackendModules:
    """Writes one-op backend modules into a folder on sys.path (for this process) and on
    PYTHONPATH (for the fresh interpreter the kit's import check starts)."""

    def __init__(self, folder, monkeypatch) -> None:
        self.folder = folder
        self.names: list[str] = []
        monkeypatch.syspath_prepend(str(folder))
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")])))

    def build_log(self, name: str):
        return self.folder / f"{name}.builds"

    def write(self, name: str, purpose: str, at_import: str = "") -> str:
        source = BACKEND_MODULE.format(purpose=purpose, target=name, build_log=str(self.build_log(name)), at_import=at_import)
        (self.folder / f"{name}.py").write_text(source)
        importlib.invalidate_caches()
        self.names.append(name)
        return name

    def builds(self, name: str) -> list[str]:
        """What the module's builder logged, in any process, since the last ``forget_builds``."""
        log = self.build_log(name)
        return log.read_text().splitlines() if log.exists() else []

    def forget_builds(self, name: str) -> None:
        self.build_log(name).unlink(missing_ok=True)


@pytest.fixture
def backend_modules(tmp_path, monkeypatch) -> Iterator[BackendModules]:
    modules = BackendModules(tmp_path, monkeypatch)
    yield modules
    for name in modules.names:
        sys.modules.pop(name, None)


def import_check_of(module: str) -> Check:
    """Import ``module`` here (registering its target), then the kit's import check for it."""
    importlib.import_module(module)
    kit = TargetConformance(module, device="cpu", max_elements=SMALL_WORKLOADS, backend_module=module)
    return named(kit.checks(), f"{module}: importing {module} builds no kernel")


def test_a_backend_that_builds_nothing_at_import_passes_the_import_check(scoped_registry, backend_modules):
    module = backend_modules.write("lazy_backend", "registers its builder and builds nothing")

    import_check_of(module)()

    assert backend_modules.builds(module) == []


def test_a_backend_that_builds_at_import_fails_the_import_check_naming_the_op(scoped_registry, backend_modules):
    module = backend_modules.write("warming_backend", "warms its kernel up by running the op", WARMS_UP_THROUGH_THE_OP)
    check = import_check_of(module)
    backend_modules.forget_builds(module)  # the import in this process built once too

    with pytest.raises(AssertionError, match=r"importing warming_backend built kernels for \['RMSNormFwdOp'\]"):
        check()
    assert backend_modules.builds(module) == ["(2, 8)"]


def test_a_backend_the_fresh_interpreter_cannot_import_fails_the_import_check(scoped_registry, backend_modules, monkeypatch):
    # The kit imports the module in a fresh interpreter: sys.path entries of this process
    # (syspath_prepend) do not reach it, only an installed module or PYTHONPATH does.
    module = backend_modules.write("unreachable_backend", "importable in this process only")
    check = import_check_of(module)
    monkeypatch.delenv("PYTHONPATH")

    with pytest.raises(AssertionError, match=r"(?s)importing unreachable_backend failed:.*ModuleNotFoundError"):
        check()


@pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="kit gap: the import check counts calls of the callable handed to register_kernel_builder "
    "only, so a module that calls its build function directly at import passes it",
)
def test_a_backend_that_calls_its_builder_at_import_fails_the_import_check(scoped_registry, backend_modules):
    module = backend_modules.write("eager_backend", "calls its build function at import", CALLS_ITS_BUILDER)
    check = import_check_of(module)
    backend_modules.forget_builds(module)  # the import in this process built once too

    outcome = run_checks([check])

    if backend_modules.builds(module) != ["(2, 8)"]:  # pytest.fail is no AssertionError: not the xfail
        pytest.fail(f"the fault did not happen in the kit's interpreter: {backend_modules.builds(module)}")
    error = outcome[check.name]
    assert isinstance(error, AssertionError), "the kit did not report a builder called at import"
    assert "RMSNormFwdOp" in str(error)


# -- ops a target does not serve ----------------------------------------------------------------------------
def test_ops_a_target_does_not_serve_pass_the_not_served_checks(scoped_registry):
    for op in (RMSNormFwdOp, LayerNormFwdOp):
        register_kernel_builder(op=op.__name__, target="partial", build_kernel=ACME_BUILDERS[op])
    kit = small_kit("partial")

    not_served = [check for check in kit.checks() if check.name.endswith(("is not served and says so", "runs its own torch code"))]

    assert kit.served_ops() == [RMSNormFwdOp, LayerNormFwdOp]
    assert [check.name for check in not_served] == [  # every other op, in the order FAMILIES lists them
        not_served_check("partial", op) for ops in FAMILIES.values() for op in ops if op not in (RMSNormFwdOp, LayerNormFwdOp)
    ]
    assert not_served_check("partial", LinearCrossEntropyBwdOp).endswith("runs its own torch code")
    assert not_served_check("partial", FusedAddLayerNormFwdOp) in [check.name for check in not_served]
    assert failures(run_checks(not_served)) == {}


# -- added kernel types ---------------------------------------------------------------------------------------
class RowsUpTo1K(Kernel, RMSNormFwdInterface):
    """An added RMSNorm meant for rows of at most 1024 elements on CPU; it beats the in-tree
    ``torch_cpu`` kernel, which is general, wherever it does not refuse."""

    devices = frozenset({"cpu"})
    longest_row_served: ClassVar[int | None] = 1024  # None: serves every row

    def __init__(self, n: int, eps: float) -> None:
        super().__init__()
        self.n, self.eps = n, eps

    @classmethod
    def refusal(cls, call: RMSNormCall) -> str | None:
        if cls.longest_row_served is None or call.n <= cls.longest_row_served:
            return None
        return f"serves rows of at most {cls.longest_row_served} elements, this call's rows have {call.n}"

    @classmethod
    def entry_for(cls, call: RMSNormCall):
        return (call.n, call.eps), lambda: cls(call.n, call.eps)

    def forward(self, x, weight):
        w = None if weight is None else weight.float()
        return F.rms_norm(x.float(), (self.n,), w, self.eps).to(x.dtype)


class RefusesItsOwnRegion(RowsUpTo1K):
    """Refusal too broad: turns down rows above 128, though it is meant to serve up to 1024."""

    longest_row_served = 128


class ServesEveryRow(RowsUpTo1K):
    """Refusal too narrow: never refuses, so it serves rows above 1024 too."""

    longest_row_served = None


KERNEL_TYPE_KEY = "rows_up_to_1k"
ROW_OF_512 = {"shapes": {"x": [4, 512], "weight": [512]}, "params": {"normalized_shape": [512]}, "dtype": "float32"}
ROW_OF_2048 = {"shapes": {"x": [4, 2048], "weight": [2048]}, "params": {"normalized_shape": [2048]}, "dtype": "float32"}
SERVES_512 = f"{KERNEL_TYPE_KEY}: serves {ROW_OF_512['shapes']} float32"
LEAVES_2048 = f"{KERNEL_TYPE_KEY}: leaves {ROW_OF_2048['shapes']} float32 to others"


@pytest.mark.parametrize(
    ("kernel_type", "failing_check", "problem"),
    [
        (RowsUpTo1K, None, None),
        (RefusesItsOwnRegion, SERVES_512, "served by {'torch_cpu'}, expected 'rows_up_to_1k'"),
        (ServesEveryRow, LEAVES_2048, "'rows_up_to_1k' served a call outside its region"),
    ],
    ids=lambda value: getattr(value, "__name__", None),
)
def test_an_added_kernel_type_is_checked_inside_and_outside_its_region(scoped_registry, kernel_type, failing_check, problem):
    register_kernel_type("RMSNormFwdOp", KERNEL_TYPE_KEY, kernel_type)
    kit = KernelTypeConformance(RMSNormFwdOp, KERNEL_TYPE_KEY, device="cpu", inside=[ROW_OF_512], outside=[ROW_OF_2048])

    outcomes = run_checks(kit.checks())

    assert set(outcomes) == {f"{KERNEL_TYPE_KEY}: registered for RMSNormFwdOp", SERVES_512, LEAVES_2048}
    failed = failures(outcomes)
    assert set(failed) == ({failing_check} if failing_check else set())
    for error in failed.values():
        assert isinstance(error, AssertionError)
        assert problem in str(error)


def test_the_kit_uses_public_names_only():
    """The kit is what a backend's tests run: it reaches TileOPs through ``tileops.backend``,
    ``tileops.core``'s own exports, the manifest's data model and the op classes."""
    import tileops.testing as testing

    public = {"tileops.backend", "tileops.core", "tileops.core.manifest", "tileops.ops"}
    for module in (testing, testing.conformance):
        tree = ast.parse(open(module.__file__, encoding="utf-8").read())
        imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level == 0}
        imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
        tileops_modules = {name for name in imported if name.split(".")[0] == "tileops"}
        assert tileops_modules <= public, f"{module.__name__} imports {sorted(tileops_modules - public)}"
