"""``tileops bench --sweep``, on CPU: the sampler (reproducible from its seed, covering every op,
dtype, rank, optional input and strided calls, within the size cap, every call accepted by the
op's signature), the statistics of the ratio to the best other side (with a fake timer), and the
command line's flags. The timings themselves need a CUDA GPU: ``tileops bench --sweep`` there."""

from __future__ import annotations

import json
import math
import random
import threading

import pytest
import torch

from tileops.cli import main, sweep, sweep_report
from tileops.cli.bench_report import Row
from tileops.cli.peers import ABSENT, Peers
from tileops.testing import workload_inputs

import test_bench_peers

#: The CPU stand-ins for a training row (CUDA streams, the device, a timer saying 1 µs).
cpu_training = test_bench_peers.cpu_training

NO_CUDA = "tileops bench needs a CUDA device: the benchmarks time GPU kernels by CUDA-graph replay"


def run_cli(capsys, *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out + err


@pytest.fixture(scope="module")
def spaces():
    return sweep.spaces()


@pytest.fixture(scope="module")
def calls(spaces):
    return sweep.draw(200, 7, spaces)


def _timed_every_way(call) -> bool:
    """Whether the call's op has a torch baseline and a backward: eager and training rows both time it."""
    entry = call.op_class.manifest_entry()
    return entry.torch_api is not None and entry.backward is not None


# -- the sampler ------------------------------------------------------------------------------------

def test_the_same_seed_draws_the_same_calls_and_another_seed_others(spaces, calls):
    again = sweep.draw(200, 7, spaces)
    assert [c.record() for c in again] == [c.record() for c in calls]
    other = sweep.draw(200, 8, spaces)
    assert [c.record() for c in other] != [c.record() for c in calls]
    assert [c.index for c in calls] == list(range(1, 201))


@pytest.mark.parametrize("seed", [0, 1, 7, 12345])
def test_200_draws_cover_every_op_dtype_rank_optional_input_choice_and_strided_calls(spaces, seed):
    drawn = sweep.draw(200, seed, spaces)
    assert {c.op_class.__name__ for c in drawn} == set(spaces)
    for name, space in spaces.items():
        of_op = [c for c in drawn if c.op_class.__name__ == name]
        assert {str(c.dtype).removeprefix("torch.") for c in of_op} == set(space.dtypes), name
        assert {len(c.shape) for c in of_op} == set(space.ranks), name
        assert {c.omitted for c in of_op} == set(space.omit), name
        assert {c.template for c in of_op} == set(space.templates), name
        views = {t.name for t in space.op_class.manifest_entry().inputs} & set(space.strided_inputs)
        if views and space.strided_share:
            assert any(c.strided for c in of_op) and any(not c.strided for c in of_op), name
        else:
            assert not any(c.strided for c in of_op), name
        for param, values in space.params.items():
            assert {c.workload.params[param] for c in of_op} == set(values), (name, param)
    rows = [math.prod(c.shape[:-1]) for c in drawn]
    assert min(rows) == 1 and sum(r <= 64 for r in rows) >= 50 and max(rows) > 4096
    assert any(r % 2 for r in rows if r > 64)


def _family_spaces(spaces, family):
    from tileops.ops import FAMILIES

    return {name: space for name, space in spaces.items() if space.op_class in FAMILIES[family]}


def test_the_norm_family_declares_the_widths_users_have(spaces):
    from tileops.ops.norm import command_line

    widths = set(command_line.HIDDEN_SIZES) | set(command_line.HEAD_SIZES)
    assert {768, 4096, 5120, 7168, 18432, 64, 128, 256} <= widths
    norm = _family_spaces(spaces, "norm")
    assert set().union(*(set(space.widths) for space in norm.values())) == widths
    assert set(norm) == {"RMSNormFwdOp", "LayerNormFwdOp", "FusedAddRMSNormFwdOp", "FusedAddLayerNormFwdOp"}


def test_the_activation_softmax_and_loss_families_declare_the_sizes_models_have(spaces):
    from tileops.ops.activation import command_line as activation
    from tileops.ops.loss import command_line as loss
    from tileops.ops.softmax import command_line as softmax

    # Llama 3 8B / Mistral 7B, Qwen2.5 7B, Llama 3 70B, Llama 2 7B and BERT's intermediate sizes.
    assert {14336, 18944, 28672, 11008, 3072} <= set(activation.INTERMEDIATE_SIZES)
    # Llama 3, Qwen2, Gemma and GPT-2's vocabularies (50257: no 16-byte access divides its rows).
    assert {128256, 151936, 256000, 50257, 32000} <= set(loss.VOCABULARY_SIZES)
    assert {50257, 128256, 262144, 1024} <= set(softmax.ROW_LENGTHS)
    assert len(_family_spaces(spaces, "activation")) == 6 and len(_family_spaces(spaces, "softmax")) == 2
    assert set(_family_spaces(spaces, "loss")) == {"CrossEntropyFwdOp", "CrossEntropyPerRowFwdOp"}
    # The packed forms take [gate | up]: twice an intermediate size wide, d its half.
    packed = [c for c in sweep.draw(60, 3, spaces, ("bfloat16",)) if c.op_class.__name__.startswith("Packed")]
    assert packed and all(c.workload.params["d"] * 2 == c.shape[-1] and c.workload.params["d"] in activation.INTERMEDIATE_SIZES
                          for c in packed)


def test_every_drawn_call_fits_the_cap_and_the_ops_signature(spaces, calls):
    for call in calls:
        space = spaces[call.op_class.__name__]
        first = call.op_class.manifest_entry().inputs[0].name
        assert math.prod(call.shape) * call.dtype.itemsize <= space.max_bytes, call.workload.name
        assert any(call.shape[len(call.shape) - len(tail):] == tail for tail in space.tails()), call.workload.name
        assert call.dtype == call.workload.dtypes[0]
        assert not set(call.omitted) & set(call.workload.shapes)
        sweep.check(call)  # raises where the signature refuses the call
        inputs = sweep.meta_inputs(call)
        for name, tensor in inputs.items():
            assert tensor.is_contiguous() == (name not in call.strided), (call.workload.name, name)
        assert first not in call.strided or inputs[first].stride()[-2] == 2 * call.shape[-1]


def test_a_call_is_labelled_with_its_number_its_strided_inputs_and_the_inputs_left_out(calls):
    strided = next(c for c in calls if c.strided and c.omitted)
    assert strided.workload.name == " ".join([f"#{strided.index:03d}", "strided", *(f"no-{n}" for n in strided.omitted)])
    assert sweep.label(3, (), ()) == "#003"


def test_allocation_gives_each_value_its_share_and_log_uniform_stays_in_bounds():
    rng = random.Random(0)
    values = sweep.allocate(rng, {"a": 2, "b": 1, "c": 1}, 10)
    assert sorted(values) == ["a"] * 5 + ["b"] * 3 + ["c"] * 2  # 5, 2.5, 2.5: the first tie wins
    assert sweep.allocate(rng, {True: 0.25, False: 0.75}, 4).count(True) == 1
    draws = [sweep.log_uniform(rng, 1, 64) for _ in range(2000)]
    assert min(draws) == 1 and max(draws) == 64 and sum(d == 1 for d in draws) > sum(d == 64 for d in draws)
    assert math.prod(sweep.spread(rng, 360, 3)) == 360 and len(sweep.spread(rng, 7, 1)) == 1


def test_rope_calls_take_heads_key_heads_tables_and_options_from_a_model_template(spaces):
    from tileops.ops.rope import RotaryEmbeddingFwdOp

    space = spaces["RotaryEmbeddingFwdOp"]
    assert space.trailing == 2 and (32, 128) in space.tails() and (4, 256) in space.tails()
    workloads = {w.name: w for w in RotaryEmbeddingFwdOp.manifest_entry().workloads}
    drawn = [c for c in sweep.draw(200, 5, spaces) if c.op_class is RotaryEmbeddingFwdOp]
    for call in drawn:
        template = workloads[call.template]
        shapes = call.workload.shapes
        assert shapes["q"][-2:] == template.shapes["q"][-2:] and shapes["k"][-2:] == template.shapes["k"][-2:]
        assert shapes["cos"] == template.shapes["cos"] and shapes["position_ids"] == shapes["q"][:-2]
        assert {k: v for k, v in call.workload.params.items() if k in template.params} == template.params
    assert len({c.shape[:-2] for c in drawn}) > len(drawn) // 2  # the tokens are drawn, not the template's


def test_a_declaration_naming_what_the_op_does_not_have_is_refused(spaces):
    good = {"widths": {64: 1}, "rows": {"low": 1, "high": 8, "decode": 4, "decode_share": 0.5}, "ranks": {2: 1},
            "dtypes": {"float32": 1}}
    with pytest.raises(ValueError, match="leaves out"):
        sweep.spaces({"norm": {**good, "ops": {"RMSNormFwdOp": {"omit": {("x",): 1}}}}})
    with pytest.raises(ValueError, match="not one of its ops"):
        sweep.spaces({"norm": {**good, "ops": {"NoSuchOp": {}}}})
    with pytest.raises(ValueError, match="params the op does not have"):
        sweep.spaces({"norm": {**good, "ops": {"RMSNormFwdOp": {"params": {"alpha": {1: 1}}}}}})
    with pytest.raises(ValueError, match=r"takes templates that are not workloads of the op: \['nope'\]"):
        sweep.spaces({"norm": {**good, "ops": {"RMSNormFwdOp": {"templates": {"nope": 1}, "trailing": 1}}}})
    with pytest.raises(ValueError, match="trailing must leave its templates' first input at least one row dimension, got 2"):
        sweep.spaces({"norm": {**good, "ops": {"RMSNormFwdOp": {"templates": {"decode-1": 1}, "trailing": 2}}}})
    with pytest.raises(ValueError, match="derives params the op does not have"):
        sweep.spaces({"activation": {**good, "ops": {"SiLUFwdOp": {"width_params": {"d": 2}}}}})
    with pytest.raises(ValueError, match=r"widths \[63\] are not multiples of 2"):
        sweep.spaces({"activation": {**good, "ops": {"PackedSwiGLUFwdOp": {"widths": {63: 1, 64: 1}, "width_params": {"d": 2}}}}})


def test_strided_calls_reach_the_bench_as_row_views_of_their_own_workload_only(calls):
    from tileops.cli import bench, bench_training

    call = next(c for c in calls if c.strided and math.prod(c.shape) <= 1 << 16)
    entry = call.op_class.manifest_entry()
    real = bench.workload_inputs
    with sweep.strided_inputs(call):
        assert bench.workload_inputs is bench_training.workload_inputs is not real
        inputs = bench.workload_inputs(entry, call.workload, call.dtype, "cpu")
        other = bench_training.workload_inputs(entry, entry.workloads[0], call.dtype, "cpu")
    assert bench.workload_inputs is real and bench_training.workload_inputs is real
    expected = real(entry, call.workload, call.dtype, "cpu")
    for name, tensor in inputs.items():
        assert tensor.is_contiguous() == (name not in call.strided)
        torch.testing.assert_close(tensor, expected[name])
    assert all(t.is_contiguous() for t in other.values())


# -- one strided training call, end to end on CPU -------------------------------------------------

def test_a_strided_training_call_is_timed_end_to_end(cpu_training, calls):
    call = next(c for c in calls if c.strided and c.dtype == torch.float32 and math.prod(c.shape) <= 1 << 19 and _timed_every_way(c))
    rows = sweep.time_call(call, backward=True, with_compile=False, tune=False, others=None)
    assert [r.mode for r in rows] == ["forward+backward", "backward"]
    assert all(r.ours_error is None and r.ours_us == 1.0 and r.workload == call.workload.name for r in rows), rows
    _, timed = cpu_training
    assert [tuple(t.shape) for t in timed[0][:1]] == [call.shape]  # the step's gradient of the first input


def test_the_kernels_are_built_by_running_each_call_once_in_threads_before_the_timing(monkeypatch, calls):
    small = [c for c in calls if c.dtype == torch.float32 and math.prod(c.shape) <= 1 << 16 and _timed_every_way(c)][:4]
    assert len(small) == 4 and any(c.strided for c in small)
    ran, threads, backwards = [], set(), []
    for op_class in {c.op_class for c in small}:
        original = op_class.__call__

        def record(self, *args, _original=original, **kwargs):
            ran.append(type(self).__name__)
            threads.add(threading.current_thread().name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(op_class, "__call__", record)
    original_grad = torch.autograd.grad
    monkeypatch.setattr(torch.autograd, "grad", lambda *a, **k: backwards.append(1) or original_grad(*a, **k))
    broken = small[0].workload

    def inputs_or_error(entry, workload, dtype, device, **options):
        if workload is broken:  # this call fails; the others are built all the same
            raise RuntimeError("no kernel for this")
        return workload_inputs(entry, workload, dtype, device, **options)

    monkeypatch.setattr(sweep, "workload_inputs", inputs_or_error)
    sweep.build_kernels(small, backward=True, device="cpu", workers=2)
    assert sorted(ran) == sorted(c.op_class.__name__ for c in small[1:]) and len(backwards) == 3
    assert threads <= {f"tileops-sweep-build_{i}" for i in range(2)}


def test_a_call_that_raises_gives_rows_that_say_so(monkeypatch, calls):
    from tileops.cli import bench

    def broken(*args, **kwargs):
        raise RuntimeError("no kernel for this\nmore")

    monkeypatch.setattr(bench, "bench_workload", broken)
    (row,) = sweep.time_call(calls[0], backward=False, with_compile=False, tune=False, others=None)
    assert row.ours_us is None and row.ours_error == "RuntimeError: no kernel for this" and row.workload == calls[0].workload.name


# -- the statistics, with a fake timer ----------------------------------------------------------------

def _fake_timer(call):
    """Ours: 1 µs; eager 2 µs; compile and a peer from the call's number (a peer absent on
    every third call, refused on every fifth); call 13 has no other side."""
    n = call.index
    peer = ABSENT if n % 3 == 0 else "refused: needs a weight" if n % 5 == 0 else 0.5 + n / 100
    row = Row(op=call.op_class.__name__, workload=call.workload.name, dtype=str(call.dtype).removeprefix("torch."),
              shape="x".join(map(str, call.shape)), served_by="k", ours_us=1.0, eager_us=2.0,
              compile_us=None if n % 2 else 0.9 + n / 1000, bytes=1000, peers={"Peer": peer})
    if n == 13:
        row.eager_us, row.compile_us, row.peers = None, None, {"Peer": ABSENT}
    return [row]


def test_quantiles_and_geomean():
    assert sweep_report.quantile([4.0, 1.0, 3.0, 2.0], 0.5) == 2.5
    assert sweep_report.quantile([1.0, 2.0], 0.05) == pytest.approx(1.05)
    assert sweep_report.quantile([5.0], 0.05) == 5.0
    values = [float(v) for v in range(1, 201)]
    assert sweep_report.quantile(values, 0.05) == pytest.approx(10.95)  # between the 10th and 11th lowest
    assert sweep_report.geomean([1.0, 4.0]) == pytest.approx(2.0)


def test_the_ratio_to_the_best_other_side_its_distribution_the_worst_calls_and_what_was_left_out(calls):
    rows = sweep.time_calls(calls[:40], _fake_timer, progress=False)
    by_number = {int(r.workload.split()[0][1:]): r for r in rows}
    # The best side is the fastest that has a time; its time over ours is the ratio.
    assert sweep_report.best(by_number[1]) == ("Peer", 0.51)
    assert sweep_report.best(by_number[2]) == ("Peer", 0.52)
    assert sweep_report.best(by_number[3]) == ("eager", 2.0)  # the peer absent, compile not run
    assert sweep_report.best(by_number[6]) == ("compile", 0.906)  # the peer absent
    assert sweep_report.best(by_number[13]) is None and sweep_report.ratio_to_best(by_number[13]) is None
    ratios = [r for r in map(sweep_report.ratio_to_best, rows) if r is not None]
    described = sweep_report.summarise(rows)["forward"]
    overall = described["ratio_to_best"]["all"]
    assert overall["calls"] == 39 == len(ratios)
    assert overall["min"] == min(ratios) == 0.51
    assert overall["p5"] == pytest.approx(sweep_report.quantile(ratios, 0.05))
    assert overall["median"] == pytest.approx(sorted(ratios)[19])
    assert overall["geomean"] == pytest.approx(math.exp(sum(map(math.log, ratios)) / 39))
    assert overall["behind"] == sum(r < 1 for r in ratios) and overall["behind_3pct"] == sum(r < 0.97 for r in ratios)
    assert sum(overall["best_side"].values()) == 39
    for op in {r.op for r in rows}:
        assert described["ratio_to_best"][op]["calls"] == sum(1 for r in rows if r.op == op and r.workload.split()[0] != "#013")
    # The worst ten, lowest ratio first.
    worst = described["worst"]
    assert [w["ratio"] for w in worst] == sorted(ratios)[:10]
    assert worst[0]["call"] == by_number[1].workload and worst[0]["best_side"] == "Peer"
    assert {"op", "shape", "dtype", "ours_us", "best_us"} <= set(worst[0])
    # Left out: per side, absent, refused and not run; calls with no other side.
    left_out = described["excluded"]
    absent = sum(1 for n in range(1, 41) if n % 3 == 0 or n == 13)
    refused = sum(1 for n in range(1, 41) if n % 5 == 0 and n % 3 and n != 13)
    assert left_out["sides"]["Peer"] == {"absent": absent, "refused": refused, "not run": 0}
    assert left_out["sides"]["compile"]["not run"] == sum(1 for n in range(1, 41) if n % 2 or n == 13)
    assert left_out["sides"]["eager"] == {"absent": 0, "refused": 0, "not run": 1}
    assert left_out["no_other_side"] == 1 and left_out["ours_failed"] == 0


def test_the_distribution_is_also_given_for_strided_calls_and_for_decode_sized_ones(calls):
    # Each call's rows are what the draw chose: its first input's elements over the trailing
    # dimensions (a norm's normalized_shape; RoPE's heads and head dimension).
    for call in calls:
        tail = call.workload.params.get("normalized_shape", call.shape[-2:] if "Rotary" in call.op_class.__name__ else None)
        if tail is not None:
            assert call.rows * math.prod(tail) == math.prod(call.shape), call.record()
    rows = sweep.time_calls(calls[:60], _fake_timer, progress=False)
    grouped = sweep_report.groups(calls[:60])
    strided = {c.workload.name for c in calls[:60] if c.strided}
    decode = {c.workload.name for c in calls[:60] if c.rows <= sweep_report.DECODE_ROWS}
    assert grouped == {"strided inputs": strided, f"at most {sweep_report.DECODE_ROWS} rows": decode}
    assert strided and decode and strided != decode
    described = sweep_report.summarise(rows, grouped)["forward"]["ratio_to_best"]
    for name, labels in grouped.items():
        expected = [sweep_report.ratio_to_best(r) for r in rows if r.workload in labels]
        assert described[name]["calls"] == sum(r is not None for r in expected)
        assert described[name]["min"] == min(r for r in expected if r is not None)
    text = sweep_report.report(rows, calls[:60], seed=7, drawn=200, facts=_facts(), copy_tb_s=4.0, others=Peers({}))
    assert any(line.split()[:2] == ["strided", "inputs"] for line in text.splitlines())
    assert any(line.split()[:4] == ["at", "most", "64", "rows"] for line in text.splitlines())


def _facts():
    return {"date": "d", "gpu": "g", "driver": "v", "torch": "t", "torch_cuda": "c", "tilelang": "l", "python": "p"}


def test_the_report_in_text_json_and_csv(calls):
    rows = sweep.time_calls(calls[:20], _fake_timer, progress=False)
    others = Peers({})
    text = sweep_report.report(rows, calls[:20], seed=7, drawn=200, facts=_facts(), copy_tb_s=4.0, others=others)
    assert "sweep: seed 7, 20 of 200 drawn calls" in text
    assert "forward: ratio of the best other side's GPU time to TileOPs'" in text
    assert "worst 10 calls:" in text and "left out: TileOPs failed on 0, no other side ran on 1" in text
    assert "Peer absent on" in text and "compile not run on" in text
    strided = next(c for c in calls[:20] if c.strided)
    assert any(line.split()[1:3] == strided.workload.name.split()[:2] for line in text.splitlines() if line.startswith(strided.op_class.__name__))
    report = json.loads(sweep_report.report(rows, calls[:20], seed=7, drawn=200, facts=_facts(), copy_tb_s=4.0,
                                            others=others, form="json"))
    assert report["sweep"]["seed"] == 7 and len(report["sweep"]["calls"]) == 20 and len(report["rows"]) == 20
    assert report["sweep"]["calls"][0] == json.loads(json.dumps(calls[0].record()))
    assert report["summary"]["forward"]["ratio_to_best"]["all"]["calls"] == 19
    records = sweep_report.report(rows, calls[:20], seed=7, drawn=200, facts=_facts(), copy_tb_s=4.0, others=others,
                                  form="csv").splitlines()
    header = records[0].split(",")
    assert {"ratio_to_best", "best_side", "best_us", "strided", "omitted", "Peer_us"} <= set(header)
    assert len(records) == 21


# -- the command line -------------------------------------------------------------------------------

def test_bench_help_shows_the_sweep(capsys):
    with pytest.raises(SystemExit) as info:
        main(["bench", "--help"])
    assert info.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "--sweep [N]" in out and "--seed S" in out and "--draws LIST" in out
    assert "default 200" in out and "report on another" in out


def test_sweep_without_cuda_says_so_in_one_line_and_exits_2(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for argv in (["bench", "--sweep"], ["bench", "--sweep", "20", "--seed", "3", "--no-compile"],
                 ["bench", "--sweep", "--backward", "RMSNormFwdOp", "--dtype", "float16", "--draws", "1-5"]):
        code, out = run_cli(capsys, *argv)
        assert code == 2 and out.strip().splitlines() == [NO_CUDA], (argv, out)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--seed", "3"], "--seed and --draws go with --sweep N"),
        (["--sweep", "0"], "--sweep takes how many calls to draw, at least 1, got 0"),
        (["--sweep", "--shape", "8x64"], "--sweep draws its calls' shapes, params and inputs"),
        (["--sweep", "--no-weight"], "--sweep draws its calls' shapes, params and inputs"),
        (["--sweep", "--param", "eps=1e-6"], "--sweep draws its calls' shapes, params and inputs"),
        (["RMSNormBwdOp", "--sweep"], "RMSNormBwdOp: its family declares no sweep"),
        (["--sweep", "--dtype", "float64"], "--dtype float64: no selected op's sweep draws it"),
        (["--sweep", "10", "--draws", "5-11"], "--draws 5-11: the sweep draws 10 calls"),
        (["--sweep", "--draws", "x"], "--draws: expected numbers and ranges such as 1-50,60, got 'x'"),
    ],
)
def test_sweep_flags_that_do_not_go_together_exit_2_in_one_line_before_looking_for_a_gpu(capsys, argv, message):
    code, out = run_cli(capsys, "bench", *argv)
    assert code == 2 and len(out.strip().splitlines()) == 1 and message in out, out


def test_op_names_dtype_and_backward_narrow_the_draw():
    from tileops.cli.main import build_parser

    args = build_parser(["bench"]).parse_args(
        ["bench", "--sweep", "30", "--seed", "2", "--draws", "3-4,10", "LayerNormFwdOp", "--dtype", "float16", "--backward"]
    )
    chosen = sweep.selected_calls(args)
    assert [c.index for c in chosen] == [3, 4, 10]
    assert {c.op_class.__name__ for c in chosen} == {"LayerNormFwdOp"} and {c.dtype for c in chosen} == {torch.float16}
    args.draws = None
    assert [c.record() for c in sweep.selected_calls(args)][2] == chosen[0].record()


# -- the forward path and the whole command, on CPU -------------------------------------------------

def test_a_strided_forward_call_reaches_every_side_as_row_views(monkeypatch, calls):
    """bench_workload on CPU (its inputs built on the CPU, timers saying 1 µs): the op, torch and
    the peers are all called with the row views."""
    from tileops.cli import bench
    from tileops.testing import workload_inputs

    def on_cpu(entry, workload, dtype, device, **options):
        return workload_inputs(entry, workload, dtype, "cpu", **options)

    monkeypatch.setattr(sweep, "workload_inputs", on_cpu)
    monkeypatch.setattr(bench, "workload_inputs", on_cpu)
    monkeypatch.setattr(bench, "gpu_time_us", lambda fn: fn() is not None and 1.0)
    monkeypatch.setattr(bench, "call_times_us", lambda fns: [1.0 for fn in fns if fn() is not None])
    seen = []

    def adapter(function, inputs, params):
        seen.append({name: tensor.is_contiguous() for name, tensor in inputs.items()})
        return lambda: inputs[next(iter(inputs))] * 1

    call = next(c for c in calls if c.strided and c.dtype == torch.float32 and math.prod(c.shape) <= 1 << 19 and _timed_every_way(c))
    spy = Peers({"fake": {call.op_class.__name__: {"Spy": ("spy:F", adapter)}}}, importer=lambda name: type("M", (), {"F": 1}))
    (row,) = sweep.time_call(call, backward=False, with_compile=False, tune=False, others=spy)
    assert row.ours_error is None and row.ours_us == row.eager_us == row.peers["Spy"] == 1.0, row
    assert row.workload == call.workload.name and row.shape == "x".join(map(str, call.shape))
    assert seen == [{name: name not in call.strided for name in call.workload.shapes}]
    # Outside the call, the bench builds contiguous inputs again.
    assert all(t.is_contiguous() for t in bench.workload_inputs(call.op_class.manifest_entry(), call.workload, call.dtype, "cpu").values())


def test_the_whole_command_with_a_fake_gpu(capsys, monkeypatch):
    from tileops.cli import bench

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench, "machine", _facts)
    monkeypatch.setattr(bench, "copy_bandwidth_tb_s", lambda: 4.0)
    monkeypatch.setattr(sweep, "time_call", lambda call, **options: _fake_timer(call))
    built = []
    monkeypatch.setattr(sweep, "build_kernels", lambda calls, **options: built.append([c.index for c in calls]))
    code, out = run_cli(capsys, "bench", "--sweep", "24", "--seed", "5", "--no-compile")
    assert built == [list(range(1, 25))]  # every call's kernels built before the timing
    assert code == 0, out
    assert "sweep: seed 5, 24 of 24 drawn calls" in out and "worst 10 calls:" in out
    assert "[24/24]" in out  # the progress line, on stderr
    assert main(["bench", "--sweep", "24", "--seed", "5", "--draws", "2,4-5", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [c["index"] for c in report["sweep"]["calls"]] == [2, 4, 5] and report["sweep"]["drawn"] == 24
