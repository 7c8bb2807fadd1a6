"""Benchmark metric definitions (spec §5) and the load client against an in-process fake server."""

import asyncio
import math

import httpx
import pytest
from bench_fake_server import FakeServer, FakeServerConfig

from hyserve.bench.datasets import ids_to_text, random_dataset, sample_lengths
from hyserve.bench.metrics import (
    RequestResult,
    compute_agentic_metrics,
    compute_serve_metrics,
    parse_goodput,
    percentile,
)
from hyserve.bench.prometheus import parse_counters, prefix_hit_rate_delta
from hyserve.bench.serve_client import (
    EndpointConfig,
    ServeBenchConfig,
    arrival_gaps,
    run_serve_benchmark,
    send_request,
)

TIMEOUT_S = 20  # every async test is bounded in wall time


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT_S))


def stream(start, chunk_times, prompt_len=10):
    """A streamed request whose content chunks arrive at absolute `chunk_times` (one token each)."""
    ttft = chunk_times[0] - start
    itl = [b - a for a, b in zip(chunk_times, chunk_times[1:])]
    return RequestResult(
        success=True, prompt_len=prompt_len, output_len=len(chunk_times), start_time=start,
        ttft=ttft, latency=chunk_times[-1] - start, itl=itl,
    )


# Two requests: A = 4 tokens at 0.10, 0.12, 0.15, 0.20; B starts at 1.0, 2 tokens at 1.2, 1.3.
A = stream(0.0, [0.10, 0.12, 0.15, 0.20])
B = stream(1.0, [1.2, 1.3], prompt_len=20)


class TestServeDefinitions:
    def test_ttft_tpot_e2el_per_request(self):
        assert A.ttft == pytest.approx(0.10)
        assert A.latency == pytest.approx(0.20)
        assert A.tpot == pytest.approx((0.20 - 0.10) / 3)
        assert B.tpot == pytest.approx(0.1)

    def test_tpot_is_undefined_for_one_token_and_for_non_streamed(self):
        assert stream(0.0, [0.5]).tpot is None
        assert RequestResult(success=True, output_len=5, ttft=1, latency=1, streamed=False).tpot is None

    def test_itl_pools_every_gap_of_every_request(self):
        m = compute_serve_metrics([A, B], duration_s=2.0)
        gaps_ms = [20.0, 30.0, 50.0, 100.0]
        assert m["mean_itl_ms"] == pytest.approx(sum(gaps_ms) / 4)
        assert m["p50_itl_ms"] == pytest.approx(40.0)
        # TPOT averages per request, not per gap: (33.3 + 100) / 2.
        assert m["mean_tpot_ms"] == pytest.approx((100 / 3 + 100) / 2)

    def test_ttft_and_e2el_percentiles(self):
        m = compute_serve_metrics([A, B], duration_s=2.0)
        assert m["mean_ttft_ms"] == pytest.approx(150.0)
        assert m["p50_ttft_ms"] == pytest.approx(150.0)
        assert m["p90_ttft_ms"] == pytest.approx(190.0)
        assert m["p99_e2el_ms"] == pytest.approx(200 + 0.99 * 100)

    def test_throughputs_divide_by_the_benchmark_duration(self):
        m = compute_serve_metrics([A, B], duration_s=2.0)
        assert m["request_throughput"] == pytest.approx(1.0)
        assert m["output_throughput"] == pytest.approx(6 / 2)
        assert m["total_token_throughput"] == pytest.approx((10 + 20 + 6) / 2)

    def test_goodput_counts_requests_meeting_every_slo(self):
        slos = parse_goodput(["ttft:150", "tpot:50"])
        m = compute_serve_metrics([A, B], duration_s=2.0, goodput_slos=slos)
        assert m["good_requests"] == 1  # A: 100 ms / 33 ms; B fails TTFT (200) and TPOT (100)
        assert m["request_goodput"] == pytest.approx(0.5)
        m = compute_serve_metrics([A, B], duration_s=2.0, goodput_slos=parse_goodput(["e2el:301"]))
        assert m["good_requests"] == 2

    def test_goodput_parsing_rejects_unknown_metrics(self):
        assert parse_goodput(["ttft:1.5", "e2el:10"]) == {"ttft": 1.5, "e2el": 10.0}
        for bad in (["itl:5"], ["ttft"], ["ttft:-1"]):
            with pytest.raises(ValueError):
                parse_goodput(bad)

    def test_failed_requests_are_counted_with_their_messages_not_measured(self):
        bad = RequestResult(success=False, error="HTTP 500: boom")
        m = compute_serve_metrics([A, bad, bad], duration_s=1.0)
        assert m["completed"] == 1 and m["failed"] == 2
        assert m["errors"] == {"count": 2, "messages": [{"message": "HTTP 500: boom", "count": 2}]}
        assert m["mean_ttft_ms"] == pytest.approx(100.0)

    def test_percentile_is_linear_interpolation_and_nan_when_empty(self):
        assert percentile([1, 2, 3, 4], 90) == pytest.approx(3.7)
        assert math.isnan(percentile([], 50))


class TestAgenticDefinitions:
    # ITL per request = (E2EL - TTFT)/(OSL - 1): 10, 20, 40 ms.
    R = [stream(0.0, [0.1 + 0.01 * i for i in range(11)], 100),
         stream(0.5, [0.6 + 0.02 * i for i in range(6)], 200),
         stream(1.0, [1.1 + 0.04 * i for i in range(3)], 300)]

    def test_itl_is_per_request_and_tok_s_per_user_inverts_the_itl_percentile(self):
        m = compute_agentic_metrics(self.R)
        assert m["itl_ms"]["p50"] == pytest.approx(20.0)
        assert m["itl_ms"]["p90"] == pytest.approx(36.0)
        assert m["tok_s_per_user"]["p50"] == pytest.approx(1000 / 20.0)
        # p90 interactivity is the slow tail: 1/p90(ITL), not p90(1/ITL).
        assert m["tok_s_per_user"]["p90"] == pytest.approx(1000 / 36.0)

    def test_tok_s_per_gpu_is_total_tokens_over_first_start_to_last_end_per_gpu(self):
        m = compute_agentic_metrics(self.R, num_gpus=4)
        window = 1.18 - 0.0
        total = (100 + 200 + 300) + (11 + 6 + 3)
        assert m["window_s"] == pytest.approx(window)
        assert m["tok_s_per_gpu"] == pytest.approx(total / window / 4)
        assert m["output_tok_s_per_gpu"] == pytest.approx(20 / window / 4)
        assert m["requests_completed"] == 3

    def test_ttft_distribution(self):
        m = compute_agentic_metrics(self.R)
        assert m["ttft_ms"]["p50"] == pytest.approx(100.0)


class TestPrometheus:
    TEXT = (
        "# HELP vllm:prefix_cache_hits_total hits\n"
        '# TYPE vllm:prefix_cache_hits_total counter\n'
        'vllm:prefix_cache_hits_total{model_name="m",engine="0"} 30.0\n'
        'vllm:prefix_cache_hits_total{model_name="m",engine="1"} 10.0\n'
        'vllm:prefix_cache_queries_total{model_name="m",engine="0"} 100\n'
    )

    def test_counters_sum_over_label_sets_without_total_suffix(self):
        c = parse_counters(self.TEXT)
        assert c["vllm:prefix_cache_hits"] == 40.0
        assert c["vllm:prefix_cache_queries"] == 100.0

    def test_hit_rate_is_delta_hits_over_delta_queries(self):
        before = {"vllm:prefix_cache_hits": 10.0, "vllm:prefix_cache_queries": 50.0}
        after = parse_counters(self.TEXT)
        assert prefix_hit_rate_delta(before, after) == pytest.approx(30 / 50)
        assert prefix_hit_rate_delta(None, after) is None


class TestDatasets:
    def test_fixed_lengths_are_exact_and_ids_in_range(self):
        reqs = random_dataset(5, 33, 7, vocab_low=32, vocab_high=126, seed=1)
        assert [r.prompt_len for r in reqs] == [33] * 5 and [r.output_len for r in reqs] == [7] * 5
        assert all(32 <= t <= 126 for r in reqs for t in r.prompt_ids)
        assert random_dataset(5, 33, 7, seed=1)[0].prompt_ids == reqs[0].prompt_ids

    def test_uniform_lengths_stay_in_the_range(self):
        import numpy as np

        lens = sample_lengths(np.random.default_rng(0), 1000, 100, "uniform", 0.5)
        assert lens.min() >= 50 and lens.max() <= 150 and 90 < lens.mean() < 110

    def test_text_rendering_is_one_char_per_printable_id(self):
        assert ids_to_text([72, 105, 5]) == "Hi "


class TestArrivals:
    def test_inf_rate_sends_everything_at_once(self):
        assert arrival_gaps(4, math.inf, 1.0, 0) == [0.0] * 4

    def test_poisson_gaps_have_mean_one_over_rate(self):
        gaps = arrival_gaps(20000, 50.0, 1.0, 0)
        assert sum(gaps) / len(gaps) == pytest.approx(1 / 50, rel=0.05)


def _cfg(server, **kw):
    return EndpointConfig(base_url=server.base_url, model="fake-model", request_timeout_s=10, **kw)


async def _one(server_cfg, prompt_len=40, out=5, **endpoint_kw):
    async with FakeServer(server_cfg) as srv, httpx.AsyncClient() as client:
        r = await send_request(client, _cfg(srv, **endpoint_kw), list(range(40, 40 + prompt_len)), out)
        return r, srv


class TestClient:
    def test_streaming_completion_is_timed_chunk_by_chunk(self):
        r, srv = run(_one(FakeServerConfig(ttft_s=0.05, token_delay_s=0.01), out=5))
        assert r.success, r.error
        assert r.output_len == 5 and r.prompt_len == 40 and r.cached_tokens == 0
        assert len(r.itl) == 4
        # each gap measured as its chunk arrived (a buffered read would time them ~0 apart); one late
        # arrival under a loaded host shortens the gap after it, so the bound is on each gap's presence
        # and on their sum, not on every gap's 10 ms
        assert r.ttft >= 0.05 and all(g >= 0.003 for g in r.itl) and sum(r.itl) >= 0.036
        assert r.latency == pytest.approx(r.ttft + sum(r.itl), abs=0.01)
        body = srv.state.requests[0]
        assert body["prompt"] == list(range(40, 80)) and body["max_tokens"] == 5
        assert body["ignore_eos"] is True and body["stream_options"] == {"include_usage": True}

    def test_repeated_prompt_reports_cached_tokens_from_usage(self):
        async def twice():
            async with FakeServer(FakeServerConfig(block_size=16)) as srv, httpx.AsyncClient() as client:
                ids = list(range(40, 90))
                await send_request(client, _cfg(srv), ids, 2)
                return await send_request(client, _cfg(srv), ids, 2)

        assert run(twice()).cached_tokens == 48

    def test_chat_stream_ignores_the_role_only_first_delta(self):
        r, srv = run(_one(FakeServerConfig(), out=3, endpoint="chat"))
        assert r.success and r.output_len == 3 and len(r.itl) == 2
        assert srv.state.requests[0]["messages"][0]["role"] == "user"
        assert srv.state.requests[0]["max_completion_tokens"] == 3

    def test_non_streaming_response_counts_ttft_as_latency(self):
        r, _ = run(_one(FakeServerConfig(), out=4, stream=False))
        assert r.success and not r.streamed and r.output_len == 4
        assert r.ttft == r.latency and r.itl == [] and r.tpot is None

    def test_without_usage_each_content_chunk_is_one_token(self):
        r, _ = run(_one(FakeServerConfig(include_usage=False), out=6))
        assert r.success and r.output_len == 6

    @pytest.mark.parametrize("status", [400, 500])
    def test_http_errors_are_reported_with_the_server_message(self, status):
        cfg = FakeServerConfig(fail=lambda body: (status, "prompt is too long for max_model_len"))
        r, _ = run(_one(cfg))
        assert not r.success and r.status_code == status
        assert r.error == f"HTTP {status}: prompt is too long for max_model_len"

    def test_mid_stream_error_event_fails_the_request(self):
        r, _ = run(_one(FakeServerConfig(midstream_error_after=2), out=5))
        assert not r.success and "engine died mid-stream" in r.error

    def test_unreachable_server_is_an_error_not_an_exception(self):
        async def go():
            async with httpx.AsyncClient() as client:
                cfg = EndpointConfig(base_url="http://127.0.0.1:9", model="m", request_timeout_s=5)
                return await send_request(client, cfg, [1, 2, 3], 2)

        r = run(go())
        assert not r.success and r.error

    def test_benchmark_with_failing_requests_completes_and_reports_errors(self):
        def fail_long(body):
            return (400, "too long") if len(body["prompt"]) > 60 else None

        async def go():
            async with FakeServer(FakeServerConfig(fail=fail_long, token_delay_s=0.001)) as srv:
                reqs = random_dataset(30, 60, 4, dist="uniform", range_ratio=0.5, seed=0)
                cfg = ServeBenchConfig(endpoint=_cfg(srv), requests=reqs, request_rate=500.0, max_concurrency=4,
                                       num_warmups=2, goodput_slos={"e2el": 10_000.0}, disable_tqdm=True)
                return await run_serve_benchmark(cfg), reqs

        (m, results), reqs = run(go())
        n_bad = sum(1 for r in reqs if r.prompt_len > 60)
        assert 0 < n_bad < 30
        assert m["failed"] == n_bad and m["completed"] == 30 - n_bad
        assert m["errors"]["messages"] == [{"message": "HTTP 400: too long", "count": n_bad}]
        assert m["good_requests"] == m["completed"] and m["warmup_requests"] == 2
        assert m["total_output_tokens"] == sum(r.output_len for r in reqs if r.prompt_len <= 60)
