"""A CI-size soak (about a minute on two busy cores): five hundred mixed requests against one k3-tiny
server (see hyserve/bench/soak.py for the mix: streams, dropped streams, hang-ups, abandoned requests,
n > 1, structured outputs, over-long prompts, bad requests). Every answer must follow its kind's rule;
afterwards the server is idle with every pool back to its idle value, answers a fixed greedy request
exactly as it did before the soak, and its memory grew by a bounded amount. The 10,000-request version
is benchmarks/soak.py."""

from __future__ import annotations

import asyncio

from hyserve.bench.soak import probe, rss_bytes, run_soak
from tests.server_util import engine_pid, live_server_process, wait_idle

RSS_GROWTH_LIMIT = 128 << 20  # per process; a 10,000-request soak grew neither (docs/BENCHMARKS.md)


def test_mixed_soak_leaves_the_server_idle_correct_and_bounded():
    with live_server_process("--max-model-len", "512", "--max-num-seqs", "16") as (url, proc):
        pids = {"server": proc.pid, "engine": engine_pid(proc)}
        asyncio.run(run_soak(url, 40, seed=1))  # warm-up: first-use allocations are not growth
        assert wait_idle(url) == []
        before_answer = probe(url)
        before = {k: rss_bytes(p) for k, p in pids.items()}

        result = asyncio.run(run_soak(url, 500, seed=2))
        assert result.problems == [], result.problems[:20]
        assert sum(result.counts.values()) == 500 and len(result.counts) == 9, result.counts

        assert wait_idle(url) == []
        assert probe(url) == before_answer
        growth = {k: rss_bytes(p) - before[k] for k, p in pids.items()}
        assert all(g < RSS_GROWTH_LIMIT for g in growth.values()), growth
