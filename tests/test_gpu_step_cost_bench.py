"""benchmarks/gpu_step_cost.py on the CPU: the rows the device run measures, on a tiny preset, each step
of the planned composition and set against its floor."""

from __future__ import annotations

import pytest
from bench_util import benchmark_on_path


@pytest.fixture(scope="module")
def bench():
    with benchmark_on_path("gpu_step_cost") as module:
        yield module


def test_rows_are_decodes_prefill_and_context(bench):
    assert bench.parse_rows("32:2048:10240,1:0:0") == [(32, 2048, 10240), (1, 0, 0)]
    assert (32, 2048, 10240) in bench.parse_rows(bench.DEFAULT_ROWS)  # the mixed step at c = 32
    with pytest.raises(ValueError, match="B:P:C"):
        bench.parse_rows("0:0:5")


def test_a_bad_row_is_a_clear_error(bench, capsys):
    assert bench.main(["--rows", "1:2", "--device", "cpu"]) == 2
    assert "bad row '1:2'" in capsys.readouterr().err


def test_a_dry_run_times_every_row_as_planned_against_its_floor(bench, capsys):
    assert bench.main(["--model", "k3-tiny", "--device", "cpu", "--rows", "2:16:32,0:32:0,3:0:40", "--steps", "3",
                       "--warmup-steps", "1", "--no-append"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [r.split("|")[1:4] for r in rows[-3:]] == [[" 2 ", " 16 ", " 32 "], [" 0 ", " 32 ", " 0 "], [" 3 ", " 0 ", " 40 "]]
    assert all(r.split("|")[5].strip() == "3/3" for r in rows[-3:])  # every timed step held B decodes and P + 1
    assert all(r.split("|")[8].strip().endswith(" ms") for r in rows[-3:])  # a floor for every row
    assert "Code state: " in out and "nominal, for a CPU dry run" in out


def test_the_host_profile_dry_run_reports_every_row_under_each_instrument(capsys):
    with benchmark_on_path("gpu_step_host") as host:
        assert host.main(["--model", "k3-tiny", "--device", "cpu", "--rows", "0:16:0,2:8:24", "--steps", "1",
                          "--top", "3"]) == 0
    out = capsys.readouterr().out
    heads = [line for line in out.splitlines() if line.startswith("## row ")]
    assert [h.split(":")[0:3] for h in heads] == [["## row 0", "16", "0"], ["## row 2", "8", "24"]]
    assert out.count("aten operators by host time:") == 2 and out.count("by cumtime") == 2
    assert "llm_engine.py" in out  # the engine's own step is in the Python profile
