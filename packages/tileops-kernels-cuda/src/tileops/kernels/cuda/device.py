"""What the CUDA kernels need to know about the device they are built for."""

from __future__ import annotations

import torch

from tileops.core.device_facts import facts_for


def compile_target(device: torch.device) -> dict[str, str]:
    """The TileLang target for ``device``: CUDA for its own architecture (e.g. sm_90)."""
    facts = facts_for(device)
    return {"kind": "cuda", "arch": f"sm_{facts.arch}"}
