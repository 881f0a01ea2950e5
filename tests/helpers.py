"""Helpers the tests share: paths, the device tests run on, fresh interpreters."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

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
