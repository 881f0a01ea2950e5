"""Helpers the tests share: paths, the device tests run on, fresh interpreters."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tileops.core.call_path import CallDeclined, call_path_factory

ROOT = Path(__file__).resolve().parent.parent


def run_device() -> torch.device:
    """Where GPU-tier tests run (CUDA when present), else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


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
    call instead of running anything."""
    factory = call_path_factory(signature, params)
    if factory is None:
        return None
    call_path = factory(forward=None, run_bound=lambda call: call, runs_forward=False, check_results=True)
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
