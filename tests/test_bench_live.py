"""`hyserve bench` against a live `k3-tiny` server (not the fake one): the load client and the agentic
replayer must speak the real API (token-id prompts, `cache_salt`, `ignore_eos`, usage in the last stream
chunk, /metrics counters) and turn server errors into counted failures instead of crashing.

Runs the CLI in-process, so what is checked is what a user of `hyserve bench ...` would see.
"""

from __future__ import annotations

import json

import httpx
import pytest

from hyserve.bench.cli import main as bench_main
from tests.server_util import live_server


@pytest.fixture(scope="module")
def server() -> str:
    with live_server("--max-num-seqs", "16") as url:
        yield url


@pytest.fixture(scope="module")
def max_model_len(server: str) -> int:
    return int(httpx.get(f"{server}/v1/models", timeout=10).json()["data"][0]["max_model_len"])


def _serve(server: str, tmp_path, *flags: str) -> tuple[int, dict]:
    out = tmp_path / "serve.json"
    rc = bench_main(["serve", "--base-url", server, "--disable-tqdm", "--result-json", str(out),
                     "--save-detailed", *flags])
    return rc, json.loads(out.read_text())


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
@pytest.mark.parametrize("stream", ["--stream", "--no-stream"])
def test_bench_serve_completes_every_request_with_exact_output_lengths(server, tmp_path, endpoint, stream):
    rc, res = _serve(server, tmp_path, "--endpoint", endpoint, stream, "--num-prompts", "3",
                     "--input-len", "32", "--output-len", "5", "--max-concurrency", "2")
    assert rc == 0
    assert (res["completed"], res["failed"]) == (3, 0)
    # ignore_eos + usage from the server: every request generates exactly --output-len tokens.
    assert res["total_output_tokens"] == 15
    for r in res["requests"]:
        assert r["output_len"] == 5 and r["ttft"] > 0 and r["latency"] >= r["ttft"]
        assert r["cached_tokens"] is not None  # usage.prompt_tokens_details is read, streamed or not
        if endpoint == "completions":
            assert r["prompt_len"] == 32  # token-id prompts arrive with their exact length
        if stream == "--stream":
            # At most one gap per later token; the usage chunk adds none. Completions stream a chunk per
            # step even when its text is "" (a held-back partial UTF-8 byte), and those still count.
            assert len(r["itl"]) <= 4
            if endpoint == "completions":
                assert len(r["itl"]) >= 1


def test_bench_serve_counts_a_context_overflow_as_an_error_and_keeps_going(server, tmp_path, max_model_len):
    rc, res = _serve(server, tmp_path, "--num-prompts", "2", "--input-len", str(max_model_len + 10),
                     "--output-len", "4")
    assert rc == 1  # nothing completed
    assert (res["completed"], res["failed"]) == (0, 2)
    (err,) = res["errors"]["messages"]
    assert err["count"] == 2 and err["message"].startswith("HTTP 400")
    assert "maximum context length" in err["message"]


def test_agentic_replay_sees_prefix_hits_in_metrics_and_usage(server, tmp_path, max_model_len):
    traces, out = tmp_path / "traces.json", tmp_path / "replay.json"
    assert bench_main(["agentic", "generate", "--sessions", "6", "--seed", "3", "--out", str(traces),
                       "--context-scale", "0.01", "--turns-max", "30"]) == 0
    rc = bench_main(["agentic", "replay", "--traces", str(traces), "--base-url", server, "--concurrency", "2",
                     "--duration", "4", "--time-scale", "0.01", "--max-input-len", str(max_model_len // 4),
                     "--max-output-len", "8", "--seed", "3", "--disable-tqdm", "--result-json", str(out)])
    res = json.loads(out.read_text())
    assert rc == 0
    assert res["requests_completed"] >= 4 and res["requests_failed"] == 0
    # Turn k+1 re-sends turn k's prompt, so the server must report reuse both ways.
    assert res["prefix_hit_rate_observed_metrics"] > 0
    assert res["prefix_hit_rate_observed_usage"] > 0
    assert 0 < res["prefix_hit_rate_theoretical"] <= 1


def test_a_benchmark_server_keeps_the_callers_python_path_after_this_checkout(monkeypatch):
    import os

    from hyserve.bench.live import ROOT, server_environ

    monkeypatch.setenv("PYTHONPATH", "/opt/wheels")  # packages installed with `pip --target` live there
    env = server_environ("cuda", {"HYSERVE_CACHE_ROOT": "/tmp/c"})
    assert env["PYTHONPATH"].split(os.pathsep) == [str(ROOT), "/opt/wheels"]
    assert env["HYSERVE_CACHE_ROOT"] == "/tmp/c"
