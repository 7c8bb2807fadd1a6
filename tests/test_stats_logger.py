"""The server's periodic stats line (vLLM's LoggingStatLogger line), from the engine's stats snapshots."""

from __future__ import annotations

import argparse
import asyncio

import pytest

from hyserve.config import EngineConfig
from hyserve.entrypoints.engine_client import AsyncEngineClient
from hyserve.entrypoints.openai.server import engine_config_from_args
from hyserve.entrypoints.serve import _add_arguments
from hyserve.stats_logger import LoggingStatLogger


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def snapshot(**kw) -> dict:
    base = dict(num_running=0, num_waiting=0, kv_cache_usage=0.0, num_preemptions=0, prompt_tokens=0,
                generation_tokens=0, prefix_cache_queries=0, prefix_cache_hits=0)
    return {**base, **kw}


@pytest.fixture
def logger():
    clock, lines = Clock(), []
    return LoggingStatLogger(interval=10.0, clock=clock, emit=lines.append), clock, lines


def test_the_line_reports_the_intervals_rates_and_the_latest_gauges(logger):
    stats, clock, lines = logger
    stats.record(snapshot(num_running=3, prompt_tokens=4000, generation_tokens=50, prefix_cache_queries=4000,
                          prefix_cache_hits=1000, kv_cache_usage=0.2))
    clock.t += 10
    stats.record(snapshot(num_running=4, num_waiting=2, prompt_tokens=8000, generation_tokens=250,
                          prefix_cache_queries=4000, prefix_cache_hits=1000, kv_cache_usage=0.125, num_preemptions=1))
    assert stats.log() == lines[-1] == (
        "Avg prompt throughput: 800.0 tokens/s, Avg generation throughput: 25.0 tokens/s, Running: 4 reqs, "
        "Waiting: 2 reqs, GPU KV cache usage: 12.5%, Prefix cache hit rate: 25.0%, Preemptions: 1")


def test_each_line_counts_only_what_happened_since_the_previous_one(logger):
    stats, clock, lines = logger
    stats.record(snapshot(num_running=1, prompt_tokens=1000, generation_tokens=100, prefix_cache_queries=1000,
                          prefix_cache_hits=0))
    clock.t += 10
    stats.log()
    stats.record(snapshot(num_running=1, prompt_tokens=3000, generation_tokens=300, prefix_cache_queries=3000,
                          prefix_cache_hits=1500, num_preemptions=2))
    clock.t += 20  # a late tick: rates are per second of the actual interval
    stats.log()
    assert lines[-1].startswith("Avg prompt throughput: 100.0 tokens/s, Avg generation throughput: 10.0 tokens/s")
    assert "Prefix cache hit rate: 75.0%, Preemptions: 2" in lines[-1]


def test_an_idle_server_is_silent_after_one_line_of_zeros(logger):
    stats, clock, lines = logger
    clock.t += 10
    assert stats.log() is None  # never busy: nothing at all
    stats.record(snapshot(num_running=1, prompt_tokens=100, generation_tokens=5))
    clock.t += 10
    stats.log()
    stats.record(snapshot(prompt_tokens=100, generation_tokens=9))  # finished within the next interval
    clock.t += 10
    stats.log()
    clock.t += 10
    stats.log()  # the zeros, once
    for _ in range(3):
        clock.t += 10
        assert stats.log() is None
    assert len(lines) == 3
    assert lines[1].startswith("Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 0.4 tokens/s")
    assert lines[2].startswith("Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 0.0 tokens/s")


def test_waiting_requests_alone_make_the_server_busy(logger):
    stats, clock, lines = logger
    stats.record(snapshot(num_waiting=5))
    clock.t += 10
    assert "Running: 0 reqs, Waiting: 5 reqs" in stats.log()


def test_no_prefix_cache_queries_means_a_zero_hit_rate_not_a_division_error(logger):
    stats, clock, _ = logger
    stats.record(snapshot(num_running=1, generation_tokens=10))
    clock.t += 10
    assert "Prefix cache hit rate: 0.0%" in stats.log()


def test_the_client_feeds_every_step_snapshot_to_the_logger():
    client = AsyncEngineClient(EngineConfig(model="k3-tiny"))
    stats = snapshot(num_running=2, generation_tokens=7)
    client._on_step([], stats)
    assert client.stat_logger.latest is stats


def test_the_logger_task_logs_on_its_interval():
    lines: list[str] = []
    stats = LoggingStatLogger(interval=0.01, emit=lines.append)
    stats.record(snapshot(num_running=1))

    async def main():
        task = asyncio.create_task(stats.run())
        await asyncio.sleep(0.1)
        task.cancel()

    asyncio.run(main())
    assert lines and lines[0].startswith("Avg prompt throughput:")


def test_disable_log_stats_flag_turns_the_line_off():
    parser = argparse.ArgumentParser()
    _add_arguments(parser)
    cfg = engine_config_from_args(parser.parse_args(["k3-tiny", "--disable-log-stats"]))
    assert cfg.disable_log_stats and AsyncEngineClient(cfg).stat_logger is None
    default = engine_config_from_args(parser.parse_args(["k3-tiny"]))
    assert not default.disable_log_stats and AsyncEngineClient(default).stat_logger is not None
