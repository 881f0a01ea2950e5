"""GPU tier: the in-tree CUDA kernels pass the same conformance kit as a backend's target."""

from __future__ import annotations

import pytest

from tileops.backend import BUILTIN
from tileops.testing import TargetConformance

pytestmark = pytest.mark.gpu

kit = TargetConformance(BUILTIN, device="cuda", max_elements=None)


@pytest.mark.parametrize("check", kit.checks(), ids=str)
def test_in_tree_cuda_kernels_conform(check):
    check()
