"""``tileops bench``'s peers and its training mode (``--backward``), on CPU: the arguments, the
cells of absent and refusing peers (through a fake peer table), the norm family's peer table
(against Liger-Kernel where it is installed), and one training row built end to end with a fake
timer. The timings themselves need a CUDA GPU: ``tileops bench --backward`` there."""

from __future__ import annotations

import contextlib
import importlib
import types

import pytest
import torch
import torch.nn.functional as F

from tileops.cli import main
from tileops.cli.bench_report import Row, geometric_means, peak_memory, summary, table
from tileops.cli.peers import ABSENT, Peers, time_cell, time_cells

LIGER_REASON = "liger-kernel is not installed (the bench extra: pip install 'tileops-ops[bench]')"


def run_cli(capsys, *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out + err


# -- the command line ------------------------------------------------------------------------------

def test_bench_backward_has_help(capsys):
    with pytest.raises(SystemExit) as info:
        main(["bench", "--backward", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "usage: tileops bench" in out and "--backward" in out and "forward+backward" in out


def test_bench_backward_without_cuda_says_so_in_one_line_and_exits_2(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for argv in (["bench", "--backward"], ["bench", "--backward", "RMSNormFwdOp", "--shape", "8x64", "--no-weight"]):
        code, out = run_cli(capsys, *argv)
        assert code == 2 and out.strip().splitlines() == [
            "tileops bench needs a CUDA device: the benchmarks time GPU kernels by CUDA-graph replay"
        ], out


def test_bench_backward_refuses_an_op_that_declares_no_backward_before_looking_for_a_gpu(capsys):
    from tileops.cli.call_flags import op_classes

    plain = [name for name, op_class in op_classes().items() if op_class.manifest_entry().backward is None]
    if not plain:
        pytest.skip("every op declares a backward")
    code, out = run_cli(capsys, "bench", "--backward", plain[0])
    assert code == 2 and f"{plain[0]} declares no backward in its manifest entry" in out and len(out.strip().splitlines()) == 1


def test_bench_backward_selects_the_differentiable_ops_with_their_forward_workloads():
    from tileops.cli.bench import _cases

    cases = list(_cases((), ("decode-1",), (), differentiable=True))
    names = [op_class.__name__ for op_class, _, _ in cases]
    assert names == ["RMSNormFwdOp", "LayerNormFwdOp", "FusedAddRMSNormFwdOp", "FusedAddLayerNormFwdOp"]
    assert {workload.name for _, workload, _ in cases} == {"decode-1"}


# -- peers through a fake peer table ---------------------------------------------------------------

def _fake_library():
    library = types.ModuleType("fakepeer")

    class Scale:
        @staticmethod
        def apply(x, factor):
            if x.dtype == torch.float16:
                raise ValueError("no half precision here\nsecond line")
            return x * factor

    library.Scale = Scale
    return library


def _adapter(function, inputs, params):
    if params.get("strict"):
        return "cannot be strict"
    return lambda: function.apply(inputs["x"], 2.0)


FAKE_TABLES = {
    "fake": {
        "ScaleOp": {
            "Fast": ("fakepeer:Scale", _adapter),
            "Gone": ("notinstalled.ops:Scale", _adapter),
            "Old": ("fakepeer:Missing", _adapter),
            "Never": (None, "has no scale"),
        },
        "OtherOp": {"Fast": ("fakepeer:Scale", _adapter)},
    }
}


def _importer(name):
    if name == "fakepeer":
        return _fake_library()
    raise ModuleNotFoundError(f"No module named {name.split('.')[0]!r}")


def _timer(fn):
    fn()
    return 4.0


def test_a_peer_is_timed_or_its_cell_says_absent_or_refused_and_why():
    peers = Peers(FAKE_TABLES, importer=_importer)
    assert peers.columns == ["Fast", "Gone", "Old", "Never"]
    x = torch.ones(4)
    cells = time_cells(peers.prepare("ScaleOp", {"x": x}, {}), _timer)
    assert cells == {
        "Fast": 4.0,
        "Gone": ABSENT,
        "Old": "absent: fakepeer has no Missing (an older version?)",
        "Never": "refused: has no scale",
    }
    assert peers.notes() == ["Gone: absent here (ModuleNotFoundError: No module named 'notinstalled' (pip install 'tileops-ops[bench]'))"]
    # The adapter refuses an option; the peer refuses a dtype by raising (first line of its message).
    assert time_cells(peers.prepare("ScaleOp", {"x": x}, {"strict": True}), _timer)["Fast"] == "refused: cannot be strict"
    half = time_cells(peers.prepare("ScaleOp", {"x": x.half()}, {}), _timer)
    assert half["Fast"] == "refused: ValueError: no half precision here"
    # An op with no peer in a column gets None there (shown as '-'), not a refusal.
    assert time_cells(peers.prepare("OtherOp", {"x": x}, {}), _timer) == {"Fast": 4.0, "Gone": None, "Old": None, "Never": None}


def test_a_peer_that_runs_but_cannot_be_timed_says_failed():
    def timer(fn):
        raise RuntimeError("operation not permitted when stream is capturing")

    assert time_cell(lambda: 1, timer) == "failed: RuntimeError: operation not permitted when stream is capturing"


def _row(workload, ours, peers, **fields):
    return Row(op="ScaleOp", workload=workload, dtype="float32", shape="4", served_by="k", ours_us=ours,
               eager_us=2 * ours if ours else None, compile_us=None, bytes=4_000_000, peers=peers, **fields)


def test_the_table_shows_every_peer_cell_and_its_ratio_and_the_means_count_absent_and_refused():
    long_reason = "refused: ValueError: " + "x" * 60
    rows = [
        _row("a", 1.0, {"Fast": 3.0, "Gone": ABSENT}),
        _row("b", 2.0, {"Fast": "refused: needs a weight", "Gone": ABSENT}),
        _row("c", 4.0, {"Fast": 2.0, "Gone": ABSENT}),
        _row("d", 1.0, {"Fast": long_reason, "Gone": ABSENT}),
        _row("e", None, {"Fast": 1.0, "Gone": ABSENT}, ours_error="RuntimeError: no output requires grad"),
    ]
    text = table(rows, 4.0, "method line", calls=False)
    lines = text.splitlines()
    assert lines[0] == "method line"
    assert "Fast µs" in lines[1] and "Gone µs" in lines[1] and "Fast/ours" in lines[1] and "call µs" not in lines[1]
    a, b, c, d, e = lines[2:7]
    assert " 3.00 " in a and " absent " in a and " 3.00 " in a.split("absent")[1]  # the time, then the ratio 3.00
    assert "refused: needs a weight" in b
    assert " 0.50 " in c.split("absent")[1]
    assert "refused: ValueError: xxx" in d and "…" in d and long_reason not in d
    assert e.split()[4] == "error"
    assert f"ScaleOp d float32: Fast: {long_reason}" in lines
    assert "ScaleOp e float32: TileOPs: RuntimeError: no output requires grad" in lines
    means = geometric_means(rows)
    assert means["peer:Fast"] == {"ratio": pytest.approx((3.0 * 0.5) ** 0.5), "workloads": 2, "slower": 1, "absent": 0, "refused": 2}
    assert means["peer:Gone"] == {"ratio": None, "workloads": 0, "slower": 0, "absent": 5, "refused": 0}
    text = summary(means)
    assert "1.22x Fast over 2 workloads (TileOPs slower on 1); Fast absent on 0, refused or failed on 2" in text
    assert "Gone timed on no workload; Gone absent on 5, refused or failed on 0" in text
    assert rows[0].record()["Fast_us"] == 3.0 and "peers" not in rows[0].record()


# -- the norm family's peers -----------------------------------------------------------------------

def _norm_peers():
    from tileops.ops.norm import OPS, command_line

    return {op_class.__name__ for op_class in OPS}, command_line.PEERS


def test_the_norm_peer_table_is_well_formed_and_names_family_ops_only():
    ops, table_ = _norm_peers()
    assert set(table_) <= ops and "RMSNormFwdOp" in table_
    for op_name, columns in table_.items():
        for column, (where, adapter) in columns.items():
            assert column and isinstance(column, str)
            if where is None:
                assert isinstance(adapter, str) and adapter, (op_name, column)
            else:
                module, colon, attribute = where.partition(":")
                assert colon and module and attribute.isidentifier(), where
                assert callable(adapter)


@pytest.mark.parametrize("column, library", [("Liger", "liger_kernel"), ("quack", "quack")])
def test_the_norm_peer_table_names_callables_each_library_has(column, library):
    pytest.importorskip(library, reason=f"{library} is not installed (the bench extra: pip install 'tileops-ops[bench]')")
    _, table_ = _norm_peers()
    for columns in table_.values():
        where, _ = columns[column]
        if where is not None:
            module, _, attribute = where.partition(":")
            assert module.split(".")[0] == library and hasattr(importlib.import_module(module), attribute), where


class _Recorder:
    """Stands for a Liger autograd function: records how it is called, computes with torch."""

    def __init__(self, compute):
        self.compute, self.calls = compute, []

    def apply(self, *args):
        self.calls.append(args)
        return self.compute(*args)


def test_the_liger_adapters_call_with_ligers_argument_order_and_refuse_what_it_cannot_take():
    _, table_ = _norm_peers()
    x, residual, weight, bias = torch.randn(3, 8), torch.randn(3, 8), torch.randn(8), torch.randn(8)

    rms_where, rms = table_["RMSNormFwdOp"]["Liger"]
    assert rms_where == "liger_kernel.ops.rms_norm:LigerRMSNormFunction"
    recorder = _Recorder(lambda x, w, eps, offset, casting, in_place: F.rms_norm(x, (x.shape[-1],), w, eps))
    call = rms(recorder, {"x": x, "weight": weight}, {"normalized_shape": [8], "eps": None})
    torch.testing.assert_close(call(), F.rms_norm(x, (8,), weight))
    assert recorder.calls[0][2:] == (torch.finfo(torch.float32).eps, 0.0, "llama", False)
    assert rms(recorder, {"x": x.view(3, 2, 4), "weight": weight.view(2, 4)}, {"normalized_shape": [2, 4], "eps": 1e-6}) == (
        "normalizes over the last dimension only, not 2"
    )

    _, layer = table_["LayerNormFwdOp"]["Liger"]
    recorder = _Recorder(lambda x, w, b, eps: F.layer_norm(x, (x.shape[-1],), w, b, eps))
    call = layer(recorder, {"x": x, "weight": weight, "bias": bias}, {"normalized_shape": [8], "eps": 1e-5})
    torch.testing.assert_close(call(), F.layer_norm(x, (8,), weight, bias, 1e-5))
    assert layer(recorder, {"x": x, "weight": weight}, {"normalized_shape": [8], "eps": 1e-5}) == "needs weight and bias"

    _, fused = table_["FusedAddRMSNormFwdOp"]["Liger"]
    recorder = _Recorder(lambda x, r, w, eps, *rest: (F.rms_norm(x + r, (8,), w, eps), x + r))
    y, total = fused(recorder, {"x": x, "residual": residual, "weight": weight}, {"normalized_shape": [8], "eps": 1e-6})()
    torch.testing.assert_close(total, x + residual)
    assert recorder.calls[0][3:] == (1e-6, 0.0, "llama", False)
    assert fused(recorder, {"x": x, "residual": residual}, {"normalized_shape": [8], "eps": None}) == "needs a weight"

    where, reason = table_["FusedAddLayerNormFwdOp"]["Liger"]
    assert where is None and reason == "has no fused add+LayerNorm"


def test_the_quack_adapters_call_rmsnorm_as_quack_takes_it_and_refuse_what_it_cannot_take():
    _, table_ = _norm_peers()
    x, residual, weight = torch.randn(3, 8), torch.randn(3, 8), torch.randn(8)
    calls = []

    def rmsnorm(x, weight=None, *, residual=None, eps=1e-6, prenorm=False):  # quack.rmsnorm's keywords
        calls.append((residual is not None, eps, prenorm))
        total = x if residual is None else x + residual
        y = F.rms_norm(total, (x.shape[-1],), weight, eps)
        return (y, total) if prenorm else y

    where, rms = table_["RMSNormFwdOp"]["quack"]
    assert where == "quack:rmsnorm"
    torch.testing.assert_close(rms(rmsnorm, {"x": x, "weight": weight}, {"normalized_shape": [8], "eps": None})(),
                               F.rms_norm(x, (8,), weight))
    assert calls[-1] == (False, torch.finfo(torch.float32).eps, False)
    assert rms(rmsnorm, {"x": x.view(3, 2, 4)}, {"normalized_shape": [2, 4], "eps": 1e-6}) == (
        "normalizes over the last dimension only, not 2"
    )
    where, fused = table_["FusedAddRMSNormFwdOp"]["quack"]
    assert where == "quack:rmsnorm"
    y, total = fused(rmsnorm, {"x": x, "residual": residual}, {"normalized_shape": [8], "eps": 1e-6})()
    torch.testing.assert_close(total, x + residual)
    torch.testing.assert_close(y, F.rms_norm(x + residual, (8,), None, 1e-6))
    assert calls[-1] == (True, 1e-6, True)
    assert table_["LayerNormFwdOp"]["quack"][0] is None and table_["FusedAddLayerNormFwdOp"]["quack"][0] is None


# -- one training row, end to end on CPU -----------------------------------------------------------

class _Stream:
    def wait_stream(self, other):
        pass


@pytest.fixture
def cpu_training(monkeypatch):
    """bench_training on CPU: its device, CUDA streams as no-ops, and a timer that runs the call
    once and says 1 µs."""
    from tileops.cli import bench, bench_training

    monkeypatch.setattr(bench_training, "DEVICE", "cpu")
    monkeypatch.setattr(torch.cuda, "Stream", _Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: _Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    timed = []

    def timer(fn):
        timed.append(fn())
        return 1.0

    monkeypatch.setattr(bench, "gpu_time_us", timer)
    # Peak memory is read from CUDA's allocator: here each measured side says 2 MiB.
    monkeypatch.setattr(bench_training, "peak_mib", lambda call: (call(), 2.0)[1])
    return bench_training, timed


def test_a_training_row_times_every_side_and_counts_forward_and_backward_bytes(cpu_training):
    from tileops.core.manifest import Workload
    from tileops.ops import FusedAddRMSNormFwdOp, LayerNormFwdOp

    bench_training, timed = cpu_training
    liger = Peers({"norm": {"FusedAddRMSNormFwdOp": {"Liger": ("fused:F", lambda f, i, p: f.apply(i, p))},
                            "LayerNormFwdOp": {"Liger": (None, "has no such op")}}},
                  importer=lambda name: types.SimpleNamespace(F=types.SimpleNamespace(
                      apply=lambda i, p: lambda: (F.rms_norm(i["x"] + i["residual"], (16,), i["weight"]), i["x"] + i["residual"]))))
    workload = Workload("w", {"x": (4, 16), "residual": (4, 16), "weight": (16,)}, (torch.float32,), {"normalized_shape": [16]})
    full, alone = bench_training.bench_training(FusedAddRMSNormFwdOp, workload, torch.float32, with_compile=False, others=liger)
    assert (full.mode, alone.mode) == ("forward+backward", "backward")
    assert full.ours_error is None and alone.ours_error is None, (full.ours_error, alone.ours_error)
    assert full.ours_us == alone.ours_us == full.eager_us == alone.eager_us == 1.0
    assert full.peers == {"Liger": 1.0} and alone.peers == {"Liger": 1.0}
    assert full.compile_us is None
    # Every side of the training step has its peak memory, and the table prints it under the rows.
    assert full.peak_mib == {"ours": 2.0, "eager": 2.0, "Liger": 2.0} and alone.peak_mib == {}
    assert peak_memory([full, alone]).splitlines()[1:] == ["FusedAddRMSNormFwdOp w float32: ours 2.0, eager 2.0, Liger 2.0"]
    assert full.record()["Liger_peak_mib"] == 2.0
    # Backward bytes: the incoming gradients of y and of the sum, the sum, dsum (4 x 4x16 floats),
    # rstd (4 floats), weight and dweight (2 x 16 floats); forward bytes as its roofline says.
    backward_bytes = 4 * 64 * 4 + 4 * 4 + 2 * 16 * 4
    assert alone.bytes == backward_bytes
    assert full.bytes == backward_bytes + (4 * 64 * 4 + 16 * 4)
    # A training step's gradients: x, residual and weight, from the forward's outputs.
    assert [tuple(t.shape) for t in timed[0]] == [(4, 16), (4, 16), (16,)]

    workload = Workload("w", {"x": (2, 3, 16)}, (torch.float32,), {"normalized_shape": [3, 16]})
    full, alone = bench_training.bench_training(LayerNormFwdOp, workload, torch.float32, with_compile=False, others=liger)
    assert full.ours_error is None and alone.ours_error is None
    assert full.peers == alone.peers == {"Liger": "refused: has no such op"}


def test_a_training_row_of_the_linear_cross_entropy_derives_the_saved_gradients_from_the_derived_targets(cpu_training):
    # The backward's saved gradients are derived from target_ids, itself derived: the backward
    # alone must run on the same targets the forward saw, not on a missing tensor.
    from tileops.ops import LinearCrossEntropyFwdOp

    bench_training, _ = cpu_training
    workload = LinearCrossEntropyFwdOp.manifest_entry().workloads[0]
    full, alone = bench_training.bench_training(LinearCrossEntropyFwdOp, workload, torch.float32, with_compile=False)
    assert full.ours_error is None and alone.ours_error is None, (full.ours_error, alone.ours_error)
    assert full.ours_us == alone.ours_us == 1.0
    assert alone.bytes > 0


def test_a_training_row_whose_backward_inputs_do_not_fit_still_times_the_step_and_says_why(cpu_training, monkeypatch):
    # The backward op's inputs come from one more run of the forward beside the step's tensors:
    # where the GPU cannot hold them, the backward alone has no time and the step keeps its own.
    from tileops.ops import CrossEntropyFwdOp

    bench_training, _ = cpu_training

    def too_large(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 18.55 GiB.")

    monkeypatch.setattr(bench_training, "backward_inputs", too_large)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    workload = CrossEntropyFwdOp.manifest_entry().workloads[0]
    full, alone = bench_training.bench_training(CrossEntropyFwdOp, workload, torch.float32, with_compile=False)
    assert full.ours_error is None and full.ours_us == 1.0 and alone.ours_us is None
    assert alone.ours_error.startswith("the backward op's inputs did not fit: ") and "18.55 GiB" in alone.ours_error
    assert full.bytes == alone.bytes == 0  # no bandwidth where the backward's bytes are unknown


def test_a_peer_that_cannot_be_captured_is_timed_by_eager_loops_and_its_cell_says_so(monkeypatch):
    # Liger-Kernel's cross-entropy reads the target count back to the host inside each call, which
    # a CUDA-graph capture refuses: the table gives its per-call time from eager loops, marked.
    from tileops.cli import bench
    from tileops.cli.peers import LOOP_NOTE, LoopTime

    def no_capture(fn):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(bench, "gpu_time_us", no_capture)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    calls = []
    cells = time_cells({"Liger": lambda: calls.append(1), "SDPA flash": None}, bench.peer_time_us)
    assert isinstance(cells["Liger"], LoopTime) and cells["Liger"] > 0
    assert len(calls) > bench.CALLS  # the refusal check, then the loops
    row = Row(op="CrossEntropyFwdOp", workload="w", dtype="bfloat16", shape="4x8", served_by="", ours_us=2.0,
              eager_us=None, compile_us=None, bytes=0, peers=cells)
    text = table([row], 4.0, "method")
    assert f"{cells['Liger']:.2f}*" in text and LOOP_NOTE in text
    assert f"{cells['Liger'] / 2.0:.2f}" in text  # the ratio is still given
    # A peer of other families' ops only (None in every row) gets no column of dashes.
    assert "SDPA flash" not in text and "SDPA flash" not in summary(geometric_means([row]))
