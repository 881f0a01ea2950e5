"""GPU tier: ``tileops.core.timing`` on CUDA, where a timed call can spoil the process for the
calls after it.

They need a CUDA GPU (``pytest -m gpu``); elsewhere they skip.
"""

from __future__ import annotations

import pytest
import torch

from tileops.core.timing import gpu_time_us

pytestmark = pytest.mark.gpu


def test_a_call_that_cannot_be_captured_raises_and_leaves_random_numbers_working():
    x = torch.ones(1024, device="cuda")
    with pytest.raises(RuntimeError):  # torch.AcceleratorError is one
        gpu_time_us(lambda: x.sum().item(), calls=2, replays=1, warmup=1)  # a host sync: no capture
    # The next side of a benchmark draws its gradients with torch.randn on the device.
    assert torch.randn(8, device="cuda").isfinite().all()
    assert gpu_time_us(lambda: x.mul(2), calls=2, replays=2, warmup=1) > 0
