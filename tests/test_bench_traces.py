"""Synthetic agentic traces (spec §5 generator), theoretical hit rate, prompt synthesis and replay."""

import asyncio
import json
import math

import numpy as np
import pytest
from bench_fake_server import FakeServer, FakeServerConfig

from hyserve.bench import sweep
from hyserve.bench.cli import main as bench_main
from hyserve.bench.plots import pareto_front
from hyserve.bench.replay import BlockFiller, ReplayConfig, Replayer, run_replay
from hyserve.bench.serve_client import EndpointConfig
from hyserve.bench.sweep import run_sweep, write_sweep_outputs
from hyserve.bench.traces import (
    GeneratorConfig,
    generate_traces,
    hit_tokens,
    iter_requests,
    load_traces,
    theoretical_hit_rate,
    trace_stats,
)

BS = 64
TRACE_FIELDS = {"id", "models", "block_size", "hash_id_scope", "tool_tokens", "system_tokens", "requests"}
REQUEST_FIELDS = {"t", "type", "model", "in", "out", "hash_ids", "input_types", "output_types", "stop",
                  "api_time", "think_time"}


@pytest.fixture(scope="module")
def traces():
    return generate_traces(GeneratorConfig(sessions=24, seed=7, turns_max=200, p_subagent=0.1))[0]


def top_level(trace):
    return [r for r in trace["requests"] if r.get("type") != "subagent"]


class TestGeneratorShape:
    def test_records_have_the_weka_fields(self, traces):
        for t in traces:
            assert TRACE_FIELDS <= set(t) and t["block_size"] == BS and len(t["id"]) == 36
            for r, _ in iter_requests(t):
                assert REQUEST_FIELDS <= set(r)
                assert r["stop"] in ("tool_use", "end_turn") and r["out"] >= 1

    def test_one_hash_id_per_block_including_the_trailing_partial_one(self, traces):
        for t in traces:
            for r, _ in iter_requests(t):
                assert len(r["hash_ids"]) == math.ceil(r["in"] / BS)

    def test_same_seed_same_file_and_other_seed_other_file(self):
        cfg = GeneratorConfig(sessions=3, seed=11, turns_max=60)
        a, b = generate_traces(cfg)[0], generate_traces(cfg)[0]
        assert json.dumps(a) == json.dumps(b)
        c = generate_traces(GeneratorConfig(sessions=3, seed=12, turns_max=60))[0]
        assert json.dumps(a) != json.dumps(c)

    def test_subagents_nest_their_own_requests(self, traces):
        subs = [r for t in traces for r in t["requests"] if r.get("type") == "subagent"]
        assert subs
        for s in subs:
            assert {"agent_id", "subagent_type", "status", "models", "requests"} <= set(s) and s["requests"]


class TestGeneratorStatistics:
    def test_turns_per_trace_stay_within_the_configured_range(self, traces):
        turns = [len(top_level(t)) for t in traces]
        assert min(turns) >= 20 and max(turns) <= 200
        # Heavy tail: the mean sits well above the median.
        assert np.mean(turns) > np.median(turns)

    def test_context_grows_by_output_plus_tool_result_and_reuses_full_blocks(self, traces):
        grew = compacted = 0
        for t in traces:
            shared = (t["system_tokens"] + t["tool_tokens"]) // BS
            reqs = top_level(t)
            for prev, cur in zip(reqs, reqs[1:]):
                if cur["hash_ids"][shared] not in prev["hash_ids"]:
                    compacted += 1  # the conversation restarted after the shared prefix
                    continue
                grew += 1
                assert cur["in"] > prev["in"] + prev["out"]
                keep = prev["in"] // BS
                assert cur["hash_ids"][:keep] == prev["hash_ids"][:keep]
                # The partial block and everything after it is fresh.
                assert not set(cur["hash_ids"][keep:]) & set(prev["hash_ids"])
        assert grew > 100 and compacted < 0.1 * grew

    def test_bare_and_harness_first_turns(self):
        bare = generate_traces(GeneratorConfig(sessions=10, seed=1, harness_fraction=0.0, turns_max=30))[0]
        harness = generate_traces(GeneratorConfig(sessions=10, seed=1, harness_fraction=1.0, turns_max=30))[0]
        assert all(300 <= t["requests"][0]["in"] <= 700 for t in bare)
        assert all(40_000 <= t["requests"][0]["in"] <= 120_000 for t in harness)

    def test_system_and_tool_blocks_are_shared_across_sessions(self, traces):
        for t in traces:
            shared = (t["system_tokens"] + t["tool_tokens"]) // BS
            assert t["system_tokens"] % BS == 0 and t["tool_tokens"] % BS == 0
            same = [u for u in traces if (u["system_tokens"], u["tool_tokens"]) == (t["system_tokens"], t["tool_tokens"])
                    and u["requests"][0]["hash_ids"][: t["system_tokens"] // BS]
                    == t["requests"][0]["hash_ids"][: t["system_tokens"] // BS]]
            assert all(u["requests"][0]["hash_ids"][:shared] == t["requests"][0]["hash_ids"][:shared] for u in same)
        leading = [t["requests"][0]["hash_ids"][0] for t in traces]
        assert len(set(leading)) < len(traces)  # some sessions share their first (system) block

    def test_output_lengths_follow_the_configured_lognormal(self, traces):
        outs = [r["out"] for t in traces for r, _ in iter_requests(t)]
        assert 40 < np.median(outs) < 90  # median tens (configured 60)
        assert max(outs) > 1000  # tail to thousands

    def test_think_time_is_short_after_tool_use_and_long_after_end_turn(self, traces):
        s = trace_stats(traces)
        assert s["think_time_after_tool_use_s"]["p50"] < 3 < 8 < s["think_time_after_end_turn_s"]["p50"]

    def test_subagents_gate_the_next_parent_turn(self, traces):
        for t in traces:
            reqs = t["requests"]
            for i, r in enumerate(reqs):
                if r.get("type") == "subagent" and i + 1 < len(reqs) and reqs[i + 1].get("type") != "subagent":
                    j = i
                    while j >= 0 and reqs[j].get("type") == "subagent":
                        ends = [q["t"] + q["api_time"] for q in reqs[j]["requests"]]
                        assert reqs[i + 1]["t"] >= max(ends) - 1e-3
                        j -= 1

    def test_compaction_restarts_from_the_shared_prefix_with_fresh_ids(self):
        t = generate_traces(GeneratorConfig(sessions=1, seed=2, p_compact=1.0, p_subagent=0, turns_max=25))[0][0]
        shared = (t["system_tokens"] + t["tool_tokens"]) // BS
        reqs = top_level(t)
        seen = set(reqs[0]["hash_ids"])
        for r in reqs[1:]:
            assert r["hash_ids"][:shared] == reqs[0]["hash_ids"][:shared]
            assert not set(r["hash_ids"][shared:]) & seen
            seen |= set(r["hash_ids"])

    def test_generator_rate_matches_a_direct_count(self, traces):
        rate = theoretical_hit_rate(traces)
        assert 0.5 < rate < 1.0
        assert trace_stats(traces)["theoretical_hit_rate"] == rate


class TestTheoreticalHitRate:
    # 130 tokens = 2 full blocks + 2; then 200 tokens reusing the 2 full blocks; then a request whose
    # second block was seen but the first was not (prefix caches cannot use it).
    TRACE = {"block_size": BS, "requests": [
        {"in": 130, "out": 5, "hash_ids": [0, 1, 2]},
        {"in": 200, "out": 5, "hash_ids": [0, 1, 3, 4]},
        {"in": 128, "out": 5, "hash_ids": [9, 1]},
        {"type": "subagent", "requests": [{"in": 70, "out": 5, "hash_ids": [0, 7]}]},
    ]}

    def test_hand_made_trace(self):
        # hits: 0, 128 (blocks 0,1), 0 (leading miss), 64 (subagent reuses block 0).
        assert theoretical_hit_rate([self.TRACE]) == pytest.approx((128 + 64) / (130 + 200 + 128 + 70))

    def test_partial_blocks_never_hit(self):
        assert hit_tokens(130, [0, 1, 2], {0, 1, 2}, BS) == 128

    def test_ids_are_per_trace_unless_scope_is_file(self):
        a = {"block_size": BS, "requests": [{"in": 128, "out": 1, "hash_ids": [0, 1]}]}
        assert theoretical_hit_rate([a, a]) == 0.0
        assert theoretical_hit_rate([a, a], scope="file") == pytest.approx(0.5)


class TestLoading:
    def test_json_list_object_and_jsonl(self, tmp_path, traces):
        p = tmp_path / "a.json"
        p.write_text(json.dumps(traces[:2]))
        assert load_traces(p) == traces[:2]
        p.write_text(json.dumps({"traces": traces[:2]}))
        assert load_traces(p) == traces[:2]
        p.write_text("\n".join(json.dumps(t) for t in traces[:2]))
        assert load_traces(p) == traces[:2]
        p.write_text(json.dumps([{"nope": 1}]))
        with pytest.raises(ValueError):
            load_traces(p)


class TestPromptSynthesis:
    def test_blocks_are_deterministic_in_range_and_exact_length(self):
        f = BlockFiller(32, 126, BS)
        a = f.prompt("trace:x", [5, 6, 7], 150)
        assert len(a) == 150 and all(32 <= t <= 126 for t in a)
        assert BlockFiller(32, 126, BS).prompt("trace:x", [5, 6, 7], 150) == a

    def test_shared_hash_prefix_means_identical_token_prefix(self):
        f = BlockFiller(32, 126, BS)
        a = f.prompt("trace:x", [5, 6, 7], 150)
        b = f.prompt("trace:x", [5, 6, 9, 10], 250)
        assert a[:128] == b[:128] and a[128:150] != b[128:150]
        assert f.prompt("trace:y", [5], 64) != a[:64]  # local ids do not collide across traces

    def test_short_records_are_padded_with_private_blocks(self):
        f = BlockFiller(32, 126, BS)
        assert len(f.prompt("s", [1], 200, pad_key="r1")) == 200

    def test_a_prompt_too_short_for_the_whole_salt_keeps_it_out_of_the_shared_blocks(self):
        trace = {"hash_id_scope": "global", "block_size": BS, "system_tokens": BS, "requests": []}
        endpoint = EndpointConfig(base_url="http://127.0.0.1:1", model="m")
        replayer = Replayer(ReplayConfig(traces=[trace], endpoint=endpoint))
        tree = replayer._new_tree(0)
        short, _ = replayer.build_prompt(tree, {"in": BS + 6, "hash_ids": [0, 1]}, False, "a")
        long, hit = replayer.build_prompt(tree, {"in": 4 * BS, "hash_ids": [0, 2, 3, 4]}, False, "b")
        assert hit == BS and short[:BS] == long[:BS]  # the block the theoretical hit counts is shared


def _replay_cfg(srv, traces, **kw):
    endpoint = EndpointConfig(base_url=srv.base_url, model="fake-model", request_timeout_s=10)
    base = dict(traces=traces, endpoint=endpoint, concurrency=3, duration_s=2.0, time_scale=0.001,
                max_input_len=3000, max_output_len=8, disable_tqdm=True, seed=1)
    return ReplayConfig(**(base | kw))


class TestReplay:
    SMALL = GeneratorConfig(sessions=6, seed=5, context_scale=0.01, turns_max=60, p_subagent=0.1)

    def test_replay_reports_the_agentic_metrics_and_matching_hit_rates(self):
        traces = generate_traces(self.SMALL)[0]

        async def go():
            async with FakeServer(FakeServerConfig(block_size=BS, token_delay_s=0.0005)) as srv:
                return await run_replay(_replay_cfg(srv, traces)), srv

        res, srv = asyncio.run(asyncio.wait_for(go(), 30))
        for key in ("tok_s_per_user", "ttft_ms", "itl_ms"):
            assert {"p50", "p90", "p99"} <= set(res[key])
        assert res["requests_completed"] > 20 and res["requests_failed"] == 0
        assert res["tok_s_per_gpu"] > 0
        # Same block size, per-tree salt: the fake cache hits exactly what the hash ids predict.
        assert res["prefix_hit_rate_observed_usage"] == pytest.approx(res["prefix_hit_rate_theoretical"], abs=0.02)
        assert res["prefix_hit_rate_observed_metrics"] is not None
        assert 0 < res["prefix_hit_rate_theoretical_traces"] < 1
        bodies = srv.state.requests
        assert all(len(b["prompt"]) <= 3000 and b["max_tokens"] <= 8 and b["ignore_eos"] for b in bodies)
        assert len({b["cache_salt"] for b in bodies}) >= 3  # one salt per replayed tree
        assert res["submission_valid"] is False  # short, scaled and truncated

    def test_observed_hit_rate_counts_the_requests_the_theoretical_one_counts(self):
        traces = generate_traces(self.SMALL)[0]

        async def go():
            async with FakeServer(FakeServerConfig(block_size=BS, token_delay_s=0.0005)) as srv:
                return await run_replay(_replay_cfg(srv, traces, warmup=True))

        res = asyncio.run(asyncio.wait_for(go(), 30))
        assert res["requests_warmup"] > 0  # misses the /metrics delta counts and the theoretical rate does not
        assert res["prefix_hit_rate_observed_metrics"] < res["prefix_hit_rate_observed_usage"]
        assert res["prefix_hit_rate_observed"] == res["prefix_hit_rate_observed_usage"]

    def test_a_warmup_barrier_starts_the_window_after_every_lanes_warmup(self):
        traces = generate_traces(self.SMALL)[0]

        async def go():
            async with FakeServer(FakeServerConfig(block_size=BS, token_delay_s=0.0005)) as srv:
                return await run_replay(_replay_cfg(srv, traces, warmup=True, warmup_barrier=True, keep_requests=True))

        res = asyncio.run(asyncio.wait_for(go(), 30))
        assert res["warmup_barrier"] and res["warmup_phase_s"] > 0 and res["requests_warmup"] > 0
        # the /metrics delta now starts after the warm-ups: it counts what the usage rate counts
        assert res["prefix_hit_rate_observed_metrics"] == pytest.approx(res["prefix_hit_rate_observed_usage"], abs=0.02)
        assert res["requests_completed"] > 20

    def test_server_errors_are_counted_not_raised(self):
        traces = generate_traces(GeneratorConfig(sessions=2, seed=1, context_scale=0.01, turns_max=30))[0]

        async def go():
            async with FakeServer(FakeServerConfig(fail=lambda b: (500, "boom"))) as srv:
                return await run_replay(_replay_cfg(srv, traces, duration_s=0.5))

        res = asyncio.run(asyncio.wait_for(go(), 30))
        assert res["requests_completed"] == 0 and res["requests_failed"] > 0
        assert res["errors"]["messages"][0]["message"] == "HTTP 500: boom"


class TestSweepAndCli:
    def test_pareto_front_keeps_only_undominated_points(self):
        pts = [(10, 100), (20, 80), (15, 70), (30, 20), (5, 90)]
        assert pareto_front(pts) == [(10, 100), (20, 80), (30, 20)]

    def test_sweep_points_with_one_seed_never_share_a_tree_salt(self, tmp_path, monkeypatch):
        configs = []

        async def fake_replay(cfg):
            configs.append(cfg)
            return {"concurrency": cfg.concurrency, "tok_s_per_user": {"p50": 1.0}, "tok_s_per_gpu": 1.0,
                    "ttft_ms": {"p50": 1.0}, "itl_ms": {"p50": 1.0}}

        monkeypatch.setattr(sweep, "run_replay", fake_replay)
        trace = {"block_size": BS, "requests": [{"in": 100, "out": 1, "hash_ids": [0, 1]}]}
        base = ReplayConfig(traces=[trace], endpoint=EndpointConfig(base_url="http://127.0.0.1:1", model="m"))
        asyncio.run(run_sweep(base, [1, 2], tmp_path))
        first, second = (Replayer(cfg)._new_tree(0) for cfg in configs)
        assert first.salt != second.salt and first.salt_ids != second.salt_ids

    def test_sweep_plots_from_results(self, tmp_path):
        results = [{"concurrency": c, "tok_s_per_user": {"p50": 100 / c, "p90": 80 / c, "p99": 60 / c},
                    "tok_s_per_gpu": 50 * c, "ttft_ms": {"p50": c, "p90": 2 * c, "p99": 3 * c},
                    "itl_ms": {"p50": 10 * c, "p90": 12 * c, "p99": 15 * c}} for c in (1, 2, 4)]
        paths = write_sweep_outputs(results, tmp_path)
        assert paths["pareto"].stat().st_size > 1000 and paths["latency"].stat().st_size > 1000
        assert len(json.loads(paths["summary"].read_text())) == 3

    def test_generate_command_writes_traces_and_prints_calibration(self, tmp_path, capsys):
        out = tmp_path / "t.json"
        assert bench_main(["agentic", "generate", "--sessions", "3", "--seed", "4", "--turns-max", "40",
                           "--out", str(out)]) == 0
        assert len(load_traces(out)) == 3
        assert "theoretical_hit_rate" in capsys.readouterr().out
