"""The frontier of `hyserve bench sweep`: the table, the Pareto plot and the floor line from the step cost
model (hyserve/bench/frontier.py), and a dry run of the whole sweep against a live tiny server."""

from __future__ import annotations

import json

import pytest
from server_util import live_server

from hyserve.bench.cli import main as bench_main
from hyserve.bench.frontier import floor_points, frontier_table
from hyserve.bench.sweep import write_sweep_outputs
from hyserve.bench.traces import GeneratorConfig, generate_traces, save_traces
from hyserve.entrypoints.info import resolve_config
from hyserve.planning.ceilings import H200
from hyserve.planning.step_cost import StepCostModel, StepShape


def result(c: int, user: float, gpu: float) -> dict:
    return {"concurrency": c, "tok_s_per_user": {"p50": user}, "tok_s_per_gpu": gpu, "requests_completed": 100,
            "total_input_tokens": 1_000_000, "total_output_tokens": 10_000, "prefix_hit_rate_theoretical": 0.9,
            "prefix_hit_rate_observed": 0.8, "ttft_ms": {"p50": 100.0, "p99": 900.0}, "itl_ms": {"p50": 1000 / user}}


SWEEP = [result(c, 400 / c ** 0.5, 3000 * c ** 0.6) for c in (1, 2, 4, 8, 16, 32, 64)]


def test_a_concurrencys_floor_is_its_decode_step_and_its_share_of_compute_bound_prefill():
    (p,) = floor_points([SWEEP[5]], "kimi-linear-48b-a3b")  # c = 32
    model = StepCostModel(resolve_config("kimi-linear-48b-a3b"))
    # 10,000 prompt tokens and 100 output tokens a request, 90% of the prompt cacheable at best
    decode = model.cost(StepShape(decodes=32, decode_context=10_050)).floor_s(H200)
    prefill = model.cost(StepShape(prefill=8192, prefill_context=9_000)).floor_s(H200) / 8192  # a token
    assert p.step_ms == pytest.approx(decode * 1e3) and p.tok_s_per_user == pytest.approx(1 / decode)
    assert p.cycle_ms == pytest.approx((decode + 32 * 10 * prefill) * 1e3)
    assert p.tok_s_per_gpu == pytest.approx(32 * 101 / (decode + 32 * 10 * prefill))


def test_the_floor_trades_per_user_speed_for_throughput_as_concurrency_grows():
    pts = floor_points(SWEEP, "kimi-linear-48b-a3b")
    assert [p.concurrency for p in pts] == [1, 2, 4, 8, 16, 32, 64]
    assert all(a.tok_s_per_gpu < b.tok_s_per_gpu for a, b in zip(pts, pts[1:]))
    assert all(a.tok_s_per_user > b.tok_s_per_user for a, b in zip(pts, pts[1:]))


def test_the_table_gives_each_point_against_its_floor():
    rows = frontier_table(SWEEP, floor_points(SWEEP, "kimi-linear-48b-a3b"))
    assert len(rows) == 2 + 7 and "floor tok/s/GPU" in rows[0] and "of floor" in rows[0]
    assert rows[-1].startswith("| 64 | ") and "80.0% / 90.0%" in rows[-1]
    assert "n/a" not in "".join(rows)


def test_the_sweep_writes_the_table_and_a_pareto_plot_with_the_floor_line(tmp_path):
    paths = write_sweep_outputs(SWEEP, tmp_path, floor_points(SWEEP, "kimi-linear-48b-a3b"))
    assert "floor decode step (ms)" in paths["table"].read_text()
    assert paths["pareto"].stat().st_size > 1000


def test_an_unknown_floor_device_is_a_clear_cli_error(tmp_path, capsys):
    src = tmp_path / "r.json"
    src.write_text(json.dumps(SWEEP[0]))
    assert bench_main(["sweep", "--from-results", str(src), "--floor-model", "k3-tiny", "--floor-device", "TPU",
                       "--out-dir", str(tmp_path)]) == 2
    assert "no ceilings known for --floor-device 'TPU'" in capsys.readouterr().err


def test_a_dry_run_sweeps_a_live_tiny_server_and_draws_its_frontier(tmp_path, capsys):
    traces = tmp_path / "traces.json"
    save_traces(generate_traces(GeneratorConfig(sessions=4, seed=0, context_scale=0.01, turns_max=30))[0], traces)
    out = tmp_path / "sweep"
    with live_server("--block-size", "16", "--max-model-len", "2048") as url:
        rc = bench_main(["sweep", "--traces", str(traces), "--base-url", url, "--concurrencies", "1,2",
                         "--duration", "3", "--time-scale", "0.001", "--max-input-len", "1500",
                         "--max-output-len", "4", "--disable-tqdm", "--floor-model", "k3-tiny",
                         "--out-dir", str(out)])
    assert rc == 0
    table = (out / "sweep.md").read_text().splitlines()
    assert [r.split("|")[1].strip() for r in table[2:]] == ["1", "2"]
    assert all("n/a |" not in r.split("|", 9)[-1] for r in table[2:])  # every point has its floor
    assert (out / "pareto.png").stat().st_size > 1000 and len(json.loads((out / "sweep.json").read_text())) == 2
    assert "floor tok/s/GPU" in capsys.readouterr().out
