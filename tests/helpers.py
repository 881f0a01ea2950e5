"""Helpers the tests share: paths, the device tests run on, fresh interpreters."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tileops.core.call_path import CallDeclined, call_path_factory

ROOT = Path(__file__).resolve().parent.parent


def load_tool(name: str):
    """The module of ``tools/<name>.py`` (the tools are scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_device() -> torch.device:
    """Where GPU-tier tests run (CUDA when present), else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def off_the_grid(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s values in a contiguous view one element past an allocation's start: off the
    16-byte grid, as a flat buffer viewed from an odd offset is."""
    storage = torch.empty(tensor.numel() + 1, dtype=tensor.dtype, device=tensor.device)
    return storage[1:].view(tensor.shape).copy_(tensor)


def run_python(code: str, *, env: dict[str, str] | None = None, python: str = sys.executable) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter (safe path, so the checkout is not importable)."""
    return subprocess.run(
        [python, "-P", "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONSAFEPATH": "1", **(env or {})},
        timeout=600,
    )


def run_uv(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """Run uv and fail the test with its output if it fails."""
    uv = shutil.which("uv")
    assert uv is not None, "uv is not on PATH; the README's set-up installs it"
    result = subprocess.run([uv, *args], cwd=cwd, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, f"uv {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}"
    return result


def generated_bind(signature, params, args: tuple = (), kwargs: dict | None = None):
    """The ``BoundCall`` the generated call path of an op with ``signature`` and ``params``
    makes of a call, or None where it declines it (a call only the reference binder serves).

    The path is made as for an op bound to another target, so that it hands over the checked
    call instead of running anything (a call that records autograd history too)."""
    factory = call_path_factory(signature, params)
    if factory is None:
        return None
    call_path = factory(
        forward=None, run_bound=lambda call: call, runs_forward=False, check_results=True, differentiate=lambda call: call
    )
    try:
        return call_path(*args, **(kwargs or {}))
    except (CallDeclined, TypeError):  # TypeError: Python refused the arguments, and Op.__call__ declines too
        return None


def train_side_by_side(models, data, target, *, compiled: bool, steps: int = 5, lr: float = 0.05) -> list[list[float]]:
    """Train ``models`` (equal weights) on the same batch with SGD for ``steps`` steps, each
    under ``torch.compile(fullgraph=True)`` where ``compiled``; each model's loss per step."""
    import torch.nn.functional as F

    runs = [torch.compile(m, fullgraph=True) if compiled else m for m in models]
    optimizers = [torch.optim.SGD(m.parameters(), lr=lr) for m in models]
    losses: list[list[float]] = [[] for _ in models]
    for _ in range(steps):
        for run, optimizer, history in zip(runs, optimizers, losses):
            optimizer.zero_grad()
            loss = F.mse_loss(run(data), target)
            loss.backward()
            optimizer.step()
            history.append(loss.item())
    return losses


def workload_params(cases, *, large: int = 1 << 26) -> list:
    """``cases`` as pytest params, the workloads of more than ``large`` input elements marked
    ``large_memory``: their float64 references take GiBs, and beside a test process per core
    sharing the GPU they could run it out of memory, so the GPU tier runs them one at a time."""
    return [pytest.param(case, id=case.id, marks=[pytest.mark.large_memory] * (case.elements > large)) for case in cases]


_ATTENTION_BUILD = """
import torch
from tileops.kernels.cuda.attention import policy, {programs} as programs
from {spec_module} import {spec_name} as Spec
for kind, fields in [{jobs}]:
    call = Spec(torch.device("cuda", 0), *fields)
    if kind == "fwd":
        programs.compile_forward(call, {target!r}, **policy.forward_config(call.head_dim))
    else:
        dense = programs.__name__.endswith(".programs")  # the variable-length backward has no schedule options
        config = (policy.dense_backward_config if dense else policy.backward_config)(call.head_dim)
        programs.compile_bwd_main(call, {target!r}, **config)
        programs.compile_bwd_pre(call, {target!r}, **policy.ROWS_KERNEL)
        programs.compile_bwd_post(call, {target!r}, **policy.ROWS_KERNEL)
"""


# Below this many selected tests of a module, its prebuilding fixture leaves the kernels to be
# built as the tests call them: a narrow selection (-k, a node id) calls a few of them, and
# compiling every call of the module first took minutes (the attention modules: no test had run
# after 230 s for a selection of two tests).
PREBUILD_FROM_TESTS = 8


def few_tests_selected(request: pytest.FixtureRequest) -> bool:
    """Whether fewer than ``PREBUILD_FROM_TESTS`` tests of the module that ``request`` (a
    module-scoped fixture's) comes from are selected in this session."""
    module = request.node.path
    return sum(item.path == module for item in request.session.items) < PREBUILD_FROM_TESTS


def xdist_share() -> tuple[int, int]:
    """(this test process's index, the number of test processes) under pytest-xdist; (0, 1)
    without it. Prebuilding fixtures build their share ``[index::count]`` of the kernels."""
    return int(os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:]), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))


def compile_attention_programs(calls, programs: str) -> None:
    """Compile the forward and backward programs of every attention call spec in ``calls`` (module
    ``programs`` of ``tileops.kernels.cuda.attention``) in several processes at once. TileLang's
    lowering and nvcc take seconds per program and hold the interpreter; its disk cache then hands
    the programs to the kernels the tests build, so that the tests only launch."""
    from tileops.kernels.cuda.device import compile_target

    calls = sorted(calls, key=repr)  # a set's order differs between processes; the jobs' split must not
    if not calls:
        return
    spec = type(calls[0])
    target = compile_target(calls[0].device)
    # Each call as the source of its fields after the device (dtypes print as torch.<name>).
    fields = [", ".join(repr(getattr(call, f.name)) for f in dataclasses.fields(call)[1:]) for call in calls]
    jobs = [f"({kind!r}, ({source},))" for source in fields for kind in ("bwd", "fwd")]  # the slow builds first
    # Under pytest-xdist every test process runs this: each builds its share of the jobs with its
    # share of the cores (a program another process has not built yet is built where it is used).
    share, processes_running = xdist_share()
    jobs = jobs[share::processes_running]
    if not jobs:
        return
    workers = max(1, min(len(jobs), (os.cpu_count() or 2) // (2 * processes_running)))
    processes = [
        subprocess.Popen(
            [
                sys.executable,
                "-P",
                "-c",
                _ATTENTION_BUILD.format(
                    programs=programs,
                    spec_module=spec.__module__,
                    spec_name=spec.__name__,
                    target=target,
                    jobs=", ".join(jobs[index::workers]),
                ),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for index in range(workers)
    ]
    for process in processes:
        _, err = process.communicate(timeout=1800)
        assert process.returncode == 0, err[-4000:]


def fresh_tuning_store(monkeypatch: pytest.MonkeyPatch, cache_dir: Path):
    """The tuning module with its store in ``cache_dir`` and nothing read or chosen yet."""
    from tileops.kernels.cuda import tuning

    monkeypatch.setenv("TILEOPS_CACHE_DIR", str(cache_dir))
    monkeypatch.setattr(tuning, "_chosen", {})
    monkeypatch.setattr(tuning, "_loaded", set())
    return tuning


def tuning_timed_by_config(monkeypatch: pytest.MonkeyPatch, store: Path, launched: list, fastest: dict) -> None:
    """Make tuning run on CPU tensors against a fresh store in ``store``: a candidate times 1 us
    where the configuration its launch recorded (the first item of ``launched``'s last entry)
    holds every item of ``fastest``, 2 us otherwise."""
    import contextlib

    tuning = fresh_tuning_store(monkeypatch, store)
    monkeypatch.setattr(torch.cuda, "device", lambda index: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)

    def timed(fn, **_):
        fn()
        config = launched[-1][0]
        return 1.0 if all(config.get(key) == value for key, value in fastest.items()) else 2.0

    monkeypatch.setattr(tuning, "gpu_time_us", timed)


_BARRIER = re.compile(r"mbarrier\[(.+?)\]\.(wait|arrive)\(")
_TMA_LOAD_INTO = re.compile(r"tma_load\(\w+, mbarrier\[.+?\], \(&\(\(\(\w+\*\)(\w+)\)")
_PRODUCT_READS = re.compile(r"initialize_wgmma_descriptor<[^>]*>\(\w+, \(&\(\(\(\w+\*\)(\w+)\)")
_WAIT = re.compile(r"(?:wait_wgmma|warpgroup_wait)<(\d+)>")  # an asynchronous product's wait, a synchronous one's


def hand_backs_while_read(source: str) -> tuple[dict[str, str], list[str]]:
    """In a warp-specialised kernel's CUDA source: (the barrier each pipelined buffer is handed
    back to the loads on, the buffers handed back while an issued, unwaited product still reads
    them). The loader writes the next tile into a buffer as soon as it is handed back, so a
    product that is still reading it would read that tile: a race the tests' numbers rarely show.

    The loader's branch (before the consumers' register allocation) waits on a buffer's barrier
    before each TMA load into it; the consumers' branch is read in order: a product's shared
    operands are its descriptors' buffers, ``warpgroup_commit_batch`` issues them as a group,
    ``wait_wgmma<n>`` (``warpgroup_wait<n>`` after a synchronous product) leaves the last n
    groups running, and an ``arrive`` hands a buffer back."""
    loader, consumers = source.split("warpgroup_reg_alloc<", 1)
    same_barrier = lambda expression: re.sub(r"\b([a-z]\w*?)_\d+\b", r"\1", expression)  # noqa: E731 (kb_1 is kb)
    buffer_of, waited = {}, None
    for line in loader.splitlines():
        if (match := _BARRIER.search(line)) and match[2] == "wait":
            waited = same_barrier(match[1])
        elif (match := _TMA_LOAD_INTO.search(line)) and waited is not None:
            buffer_of[waited] = match[1]
    running, group, early = [], set(), []
    for line in consumers.splitlines():
        if match := _PRODUCT_READS.search(line):
            group.add(match[1])
        elif "warpgroup_commit_batch()" in line:
            running.append(group)
            group = set()
        elif match := _WAIT.search(line):
            left = int(match[1])
            running = running[len(running) - left :] if left else []
        elif (match := _BARRIER.search(line)) and match[2] == "arrive":
            buffer = buffer_of.get(same_barrier(match[1]))
            if buffer is not None and any(buffer in reads for reads in running):
                early.append(buffer)
    return buffer_of, early
