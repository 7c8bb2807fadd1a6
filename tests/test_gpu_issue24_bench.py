"""benchmarks/gpu_issue24.py on the CPU: the one device call's whole path (two `hyserve serve` starts, first
and steady TTFT, cold prefill, the step-cost table) on k3-tiny, so the script the lead runs on the H200 is
known to work end to end."""

from __future__ import annotations

import pytest
from bench_util import benchmark_on_path


@pytest.fixture(scope="module")
def bench():
    with benchmark_on_path("gpu_issue24") as module:
        yield module


def test_the_engines_start_up_line_is_parsed_into_phases(bench):
    line = ("INFO hyserve.entrypoints.engine_client: engine ready 47.3 s after process start (load 30.2 s, cache allocation "
            "1.1 s, warm-up 9.0 s, graph capture 3.0 s, other 4.0 s)")
    assert bench.parse_ready(line) == (47.3, {"load": 30.2, "cache allocation": 1.1, "warm-up": 9.0,
                                              "graph capture": 3.0, "other": 4.0})
    assert bench.parse_ready("no such line") == (None, {})


def test_a_dry_run_starts_both_servers_and_prints_every_table(bench, capsys):
    assert bench.main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    cold_row = next(line for line in out.splitlines() if line.startswith("| --no-warmup |"))
    warm_row = next(line for line in out.splitlines() if line.startswith("| --warmup |"))
    assert "warm-up" not in cold_row and "warm-up " in warm_row  # the warm-up is a start-up phase
    assert cold_row.count("x |") == 2 and warm_row.count("x |") == 2  # first/steady ratios at both sizes
    assert "| TTFT (warmed server) | " in out and "256 tokens | 512 tokens" in out
    steps = [line for line in out.splitlines() if line.startswith("| 2 | 32 | 64 |") or line.startswith("| 0 | 64 | 0 |")]
    assert len(steps) >= 2 and all("8/8" in line for line in steps)
