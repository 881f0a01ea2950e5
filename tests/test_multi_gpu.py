"""Several devices in one process: per-device facts, kernels and launches; mixed devices refused.

The two-GPU tests need a machine with at least two CUDA devices and skip, saying so, elsewhere.
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F

from tileops.backend import OpArgumentError
from tileops.core.device_facts import facts_for
from tileops.ops import FusedAddRMSNormFwdOp, LayerNormFwdOp, RMSNormFwdOp

two_gpus = pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"
)


def test_a_call_with_tensors_on_two_devices_is_refused_before_any_kernel_runs():
    op = RMSNormFwdOp(8)
    with pytest.raises(OpArgumentError, match="'weight' is on meta, but the call's device .* is cpu"):
        op(torch.randn(2, 8), torch.randn(8, device="meta"))
    assert op.target is None and op.built_kernels() == []


@pytest.mark.gpu
@two_gpus
def test_one_op_instance_serves_two_gpus_with_kernels_built_per_device():
    op = FusedAddRMSNormFwdOp(4096)
    results = {}
    for index in (0, 1):
        device = torch.device("cuda", index)
        x = torch.randn(64, 4096, device=device, dtype=torch.bfloat16)
        r, w = torch.randn_like(x), torch.randn(4096, device=device, dtype=torch.bfloat16)
        with torch.cuda.device(0):  # the current device stays cuda:0 for both calls
            y, total = op(x, r, w)
        assert y.device == device and total.device == device
        torch.testing.assert_close(total, x + r, atol=0, rtol=0)
        expected = F.rms_norm((x + r).float(), (4096,), w.float(), torch.finfo(torch.bfloat16).eps).bfloat16()
        torch.testing.assert_close(y, expected, atol=1.6e-2, rtol=1.6e-2)
        results[index] = y
    devices = {kernel.device for _, kernel in op.built_kernels()}
    assert devices == {torch.device("cuda", 0), torch.device("cuda", 1)}
    assert facts_for(torch.device("cuda", 0)).arch == facts_for(torch.device("cuda", 1)).arch


@pytest.mark.gpu
@two_gpus
def test_mixed_gpus_in_one_call_are_refused():
    x = torch.randn(4, 256, device="cuda:0")
    w = torch.randn(256, device="cuda:1")
    with pytest.raises(OpArgumentError, match="'weight' is on cuda:1, but the call's device .* is cuda:0"):
        LayerNormFwdOp(256)(x, w)


@pytest.mark.gpu
@two_gpus
def test_concurrent_calls_from_one_thread_per_device():
    op = LayerNormFwdOp(2048)
    errors = []

    def work(index: int) -> None:
        try:
            device = torch.device("cuda", index)
            torch.cuda.set_device(device)
            for _ in range(50):
                x = torch.randn(128, 2048, device=device)
                torch.testing.assert_close(op(x), F.layer_norm(x, (2048,)), atol=1e-5, rtol=1e-5)
        except Exception as error:  # noqa: BLE001 - reported below, with the device
            errors.append((index, error))

    threads = [threading.Thread(target=work, args=(i,)) for i in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []


@pytest.mark.gpu
@two_gpus
def test_cuda_graph_capture_on_each_device():
    op = RMSNormFwdOp(1024)
    for index in (0, 1):
        device = torch.device("cuda", index)
        with torch.cuda.device(device):
            x = torch.randn(32, 1024, device=device, dtype=torch.bfloat16)
            op(x)  # warm-up builds the kernel for this device
            graph = torch.cuda.CUDAGraph()
            # A capture stream on this device: torch.cuda.graph's default one is created once per
            # process, on the first device that captures, and a capture on another device would
            # record nothing (torch's own kernels included).
            with torch.cuda.graph(graph, stream=torch.cuda.Stream(device)):
                y = op(x)
            x.copy_(torch.randn_like(x))
            graph.replay()
            torch.cuda.synchronize(device)
            expected = F.rms_norm(x.float(), (1024,), eps=torch.finfo(torch.bfloat16).eps).bfloat16()
            torch.testing.assert_close(y, expected, atol=1.6e-2, rtol=1.6e-2)
