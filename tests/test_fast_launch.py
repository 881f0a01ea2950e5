"""The C++ launch path of the CUDA kernels (tileops.kernels.cuda.fast_launch).

CPU tier: how it is turned off and what happens where it cannot be built. Compile tier (where
the CUDA toolkit is): it builds against the torch and tvm-ffi in use, once per machine, and the
Launcher hands every call it cannot launch to the Python forward. GPU tier: kernels launch
through it, with the Python forward's results.
"""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import pytest
import torch

from helpers import run_python

BUILD = """
import time
from tileops.kernels.cuda import fast_launch
start = time.perf_counter()
module = fast_launch._module()
print(module.__file__ if module else "", fast_launch.unavailable_reason(), round(time.perf_counter() - start, 1), sep="\\n")
"""


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The launch path built into a fresh cache folder by a process of its own: (cache, file)."""
    cache = tmp_path_factory.mktemp("fast-launch-cache")
    result = run_python(BUILD, env={"TILEOPS_CACHE_DIR": str(cache)})
    assert result.returncode == 0, result.stderr
    path, reason, _ = result.stdout.splitlines()
    assert path and reason == "None", result.stdout + result.stderr
    return cache, Path(path)


@pytest.fixture(scope="module")
def module(built):
    from tileops.kernels.cuda import fast_launch

    return fast_launch._load(built[1])


# -- CPU tier: turned off, or not buildable ---------------------------------------------------


def test_turned_off_by_the_environment_it_is_not_built_and_kernels_keep_the_python_forward(tmp_path):
    code = """
import warnings
warnings.simplefilter("error")
from tileops.kernels.cuda import fast_launch
declared = dict(arity=2, order=(0, 1), outputs=(0,), size_of=0, choices=(), default_build=0)
print(fast_launch.launcher(print, print, 0, **declared), fast_launch.unavailable_reason(), sep="|")
"""
    result = run_python(code, env={"TILEOPS_FAST_LAUNCH": "0", "TILEOPS_CACHE_DIR": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "None|turned off by TILEOPS_FAST_LAUNCH=0"
    assert not (tmp_path / "fast-launch").exists()


def test_without_a_compiler_one_warning_says_why_and_what_to_set(tmp_path):
    code = """
import warnings
from tileops.kernels.cuda import fast_launch
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    first = fast_launch.launcher(print, print, 0, arity=2, order=(0, 1), outputs=(0,), size_of=0, choices=(),
                                 default_build=0)
    second = fast_launch.launcher(print, print, 0, arity=3, order=(0, 1, 2), outputs=(0, 0), size_of=0,
                                  choices=((8, 2), (10, 0), (20, 1)), default_build=0)
print(first, second, len(caught), caught[0].category.__name__, sep="|")
print(caught[0].message)
"""
    result = run_python(code, env={"CXX": "no-such-c++", "TILEOPS_CACHE_DIR": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    summary, message = result.stdout.strip().split("\n", 1)
    assert summary == "None|None|1|RuntimeWarning"
    assert "no C++ compiler 'no-such-c++' on PATH (set CXX)" in message
    assert "Python forward" in message and "TILEOPS_FAST_LAUNCH=0" in message


# -- compile tier: built once per machine; what the Launcher hands to Python -----------------


@pytest.mark.compile
def test_it_is_built_once_per_machine_and_a_later_process_loads_it_without_compiling(built):
    cache, path = built
    assert path.parent.parent == cache / "fast-launch"
    code = BUILD.replace(
        "start =", "fast_launch._compile = lambda *args: (_ for _ in ()).throw(SystemExit('compiled again'))\nstart ="
    )
    result = run_python(code, env={"TILEOPS_CACHE_DIR": str(cache)})
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[:2] == [str(path), "None"]


@pytest.mark.compile
def test_threads_that_need_it_at_once_wait_for_one_compilation(tmp_path):
    code = """
import threading
from tileops.kernels.cuda import fast_launch
compiled, real = [], fast_launch._compile
fast_launch._compile = lambda *args: (compiled.append(1), real(*args))
modules = []
threads = [threading.Thread(target=lambda: modules.append(fast_launch._module())) for _ in range(3)]
for thread in threads: thread.start()
for thread in threads: thread.join()
print(len(compiled), len(modules), all(m is not None for m in modules))
"""
    result = run_python(code, env={"TILEOPS_CACHE_DIR": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["1", "3", "True"]


class _Forward:
    """A Python forward that records its calls."""

    def __init__(self) -> None:
        self.calls = []

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        return "from python"


def _launcher(module, forward, resolve=None, device=0, arity=2, order=(0, 1), outputs=(0,), size_of=0, choices=(),
              default_build=0):
    if resolve is None:
        def resolve(rank, build):
            pytest.fail("nothing to resolve")
    return module.Launcher(forward, resolve, device, arity, order, outputs, size_of, choices, default_build)


@pytest.mark.compile
def test_every_call_it_cannot_launch_goes_to_the_python_forward_unchanged(module):
    forward = _Forward()
    launcher = _launcher(module, forward)
    x, w = torch.zeros(2, 8), torch.ones(8)
    calls = [
        ((x, w), {}),  # CPU tensors
        ((x, None), {}),
        ((x,), {"weight": w}),  # keywords
        ((), {}),
        ((x,), {}),  # fewer arguments than the kernel declares
        ((x, w, w), {}),  # more
        (("x", w), {}),  # not a tensor
        ((x.to(torch.float64), w), {}),  # a dtype no kernel takes
        ((x,) * 9, {}),  # more tensors than any kernel takes
    ]
    for args, kwargs in calls:
        assert launcher(*args, **kwargs) == "from python"
    assert len(forward.calls) == len(calls)
    for (args, kwargs), (got_args, got_kwargs) in zip(calls, forward.calls):
        assert got_kwargs == kwargs and len(got_args) == len(args)
        assert all(a is b for a, b in zip(args, got_args))


@pytest.mark.compile
def test_a_launcher_with_several_builds_and_outputs_like_other_arguments_routes_cpu_calls_to_python(module):
    # Declarations a kind may make: arguments reordered, three outputs like two arguments, the
    # build chosen by the second argument's size among four; CPU tensors still go to Python.
    forward = _Forward()
    launcher = _launcher(module, forward, arity=3, order=(2, 0, 1), outputs=(1, 0, 1), size_of=1,
                         choices=((16, 3), (1024, 1), (4096, 2)), default_build=0)
    assert launcher(torch.zeros(4), torch.zeros(2, 8), None) == "from python"
    assert len(forward.calls) == 1


@pytest.mark.compile
@pytest.mark.parametrize(
    ("declared", "message"),
    [
        ({"arity": 0, "order": ()}, "arity must be 1 to 8 arguments, got 0"),
        ({"arity": 9, "order": ()}, "arity must be 1 to 8 arguments, got 9"),
        ({"order": (0, 2)}, r"order holds 2, outside \[0, 2\)"),
        ({"order": [0, 1]}, "order must be a tuple of at most 8 ints"),
        ({"order": (0, "1")}, "order must hold ints"),
        ({"outputs": ()}, "outputs must name at least one argument"),
        ({"outputs": (0,) * 5}, "outputs must be a tuple of at most 4 ints"),
        ({"outputs": (-1,)}, r"outputs holds -1, outside \[0, 2\)"),
        ({"size_of": 2}, r"size_of must be an argument position in \[0, 2\), got 2"),
        ({"default_build": 8}, r"default_build must be in \[0, 8\), got 8"),
        ({"choices": ((10, 1), (10, 2))}, "the bounds of choices must increase, and 10 follows 10"),
        ({"choices": ((10, 8),)}, r"choices\[0\] names build 8, outside \[0, 8\)"),
        ({"choices": ((10,),)}, r"choices\[0\] must be a \(bound, build\) pair of ints"),
        ({"choices": tuple((i, 0) for i in range(9))}, "choices must be a tuple of at most 8"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_declarations_outside_its_limits_are_refused_naming_them(module, declared, message):
    with pytest.raises(ValueError, match=message):
        _launcher(module, _Forward(), **declared)


@pytest.mark.compile
def test_its_device_can_be_set_to_send_every_call_to_python(module):
    launcher = _launcher(module, _Forward(), resolve=print)
    assert launcher.device == 0
    launcher.device = -1
    assert launcher.device == -1


@pytest.mark.compile
def test_a_launcher_whose_fallback_refers_back_to_it_is_collected(module):
    class Kernel:
        def forward(self, *args):
            return args

    kernel = Kernel()
    kernel.forward = _launcher(module, kernel.forward, resolve=print)  # as TileLangKernel does
    alive = weakref.ref(kernel)
    del kernel
    gc.collect()
    assert alive() is None


# -- GPU tier: kernels launch through it ------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("n", [1001, 4096, 65536], ids=lambda n: f"n{n}")
def test_kernels_launch_through_it_with_the_python_forwards_results(n, dtype):
    # 1001 reaches the scalar variant, 4096 the register one, 65536 the shared or streamed one;
    # ranks 2 and 3, every optional input present and absent.
    from tileops.ops import FusedAddLayerNormFwdOp, FusedAddRMSNormFwdOp, LayerNormFwdOp, RMSNormFwdOp

    w, b = torch.randn(n, device="cuda", dtype=dtype), torch.randn(n, device="cuda", dtype=dtype)
    affine = [(w, b), (None, b), (w, None), (None, None)]
    rms, layer, add_rms, add_layer = RMSNormFwdOp(n), LayerNormFwdOp(n), FusedAddRMSNormFwdOp(n), FusedAddLayerNormFwdOp(n)
    for shape in [(3, n), (2, 1, n)]:
        x, r = torch.randn(shape, device="cuda", dtype=dtype), torch.randn(shape, device="cuda", dtype=dtype)
        calls = [  # (op, the interface's arguments, weight, bias)
            *((rms, (x, weight), weight, None) for weight in (w, None)),
            *((layer, (x, weight, bias), weight, bias) for weight, bias in affine),
            *((add_rms, (x, r, weight), weight, None) for weight in (w, None)),
            *((add_layer, (x, r, weight, bias), weight, bias) for weight, bias in affine),
        ]
        for op, args, weight, bias in calls:
            has_weight, has_bias = weight is not None, bias is not None
            kernel = op.kernel_for(op.kernel_interfaces[0], x.device, dtype, has_weight, has_bias, True)
            assert type(kernel.forward).__name__ == "Launcher", kernel.forward
            through_op, launched, from_python = op(*args), kernel.forward(*args), type(kernel).forward(kernel, *args)
            for got in (through_op, launched):
                pairs = zip(got, from_python) if isinstance(got, tuple) else [(got, from_python)]
                assert all(torch.equal(a, b) for a, b in pairs), (type(op).__name__, shape, dtype, has_weight, has_bias)


@pytest.mark.gpu
def test_without_it_kernels_serve_every_call_from_the_python_forward(tmp_path):
    code = """
import torch, torch.nn.functional as F
from tileops.ops import FusedAddRMSNormFwdOp, RMSNormFwdOp
x = torch.randn(2, 1, 4096, device="cuda", dtype=torch.bfloat16)
r, w = torch.randn_like(x), torch.randn(4096, device="cuda", dtype=torch.bfloat16)
rms, add_rms = RMSNormFwdOp(4096), FusedAddRMSNormFwdOp(4096)
y, (z, total) = rms(x, w), add_rms(x, r, w)
torch.testing.assert_close(y, F.rms_norm(x.float(), (4096,), w.float()).bfloat16(), atol=1.6e-2, rtol=1.6e-2)
torch.testing.assert_close(total, x + r, atol=0, rtol=0)
print(all("forward" not in kernel.__dict__ for op in (rms, add_rms) for _, kernel in op.built_kernels()))
"""
    result = run_python(code, env={"TILEOPS_FAST_LAUNCH": "0", "TILEOPS_CACHE_DIR": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "True"  # after TileLang's compilation log
