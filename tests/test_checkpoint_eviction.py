"""Prefix caching under agentic load: checkpoint slots sized from the workload (planning/cache_split.py),
a checkpoint at the prompt's last full page, and eviction that keeps live sessions' newest checkpoints and
running requests' resume points (planning/eviction.py)."""

from __future__ import annotations

import random

import pytest
from prefix_cache_util import generate, tokens

from hyserve import SamplingParams
from hyserve.config import EngineConfig
from hyserve.planning.cache_split import checkpoint_slots

PARAMS = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
MIB = 1 << 20


def positions(engine) -> list[tuple[int, int]]:
    """(owner serial, position) of every checkpoint on the GPU."""
    return sorted((c.owner, c.p) for c in engine.kv.prefix.checkpoints.ckpts.values())


# ---- sizing ------------------------------------------------------------------------------------------


def test_checkpoint_slots_are_sessions_times_checkpoints_per_session():
    # the 48B shape on an H200: 29 GiB for the cache, 43.4 MB state slots, 64 sessions x 4
    cfg = EngineConfig(max_num_seqs=64, prefix_cache_checkpoints_per_session=4)
    assert checkpoint_slots(cfg, 29 << 30, 43_417_600) == 256  # the 25%-of-budget rule gave 179
    # the default 8 a session: capped at half of what the 64 running slots leave
    assert checkpoint_slots(EngineConfig(max_num_seqs=64), 29 << 30, 43_417_600) == 326
    assert checkpoint_slots(EngineConfig(max_num_seqs=8, prefix_cache_checkpoints_per_session=6), 1 << 30, MIB) == 48


def test_checkpoints_take_at_most_half_of_what_the_running_slots_leave():
    cfg = EngineConfig(max_num_seqs=64)
    assert checkpoint_slots(cfg, 164 * MIB, MIB) == 50  # (164 - 64) / 2, fewer than 64 x 8
    assert checkpoint_slots(cfg, 64 * MIB, MIB) == 4  # never fewer than four


def test_an_explicit_count_is_kept_and_no_prefix_caching_needs_none():
    assert checkpoint_slots(EngineConfig(num_checkpoint_slots=7), 1 << 30, MIB) == 7
    assert checkpoint_slots(EngineConfig(enable_prefix_caching=False), 1 << 30, MIB) == 0


def test_the_engine_plans_its_checkpoint_slots_from_the_workload(make_engine):
    engine = make_engine(max_num_seqs=5, prefix_cache_checkpoints_per_session=3)
    assert engine.kv.plan.num_checkpoint_slots == 15
    assert engine.kv.checkpoint_slots.num_slots == 15


# ---- the prompt's last full page ------------------------------------------------------------------


def test_a_prompt_sharing_only_the_previous_prompts_pages_resumes_at_its_last_full_page(make_engine):
    rng = random.Random(1)
    first = tokens(rng, 100)  # 6 full pages of 16 and 4 tokens
    nxt = first[:96] + tokens(rng, 40)  # the agentic replay's next turn: the full pages, then new tokens
    assert generate(make_engine(prefix_cache_last_full_page=False), first, PARAMS).num_cached_tokens == 0
    engine = make_engine()
    generate(engine, first, PARAMS)
    assert generate(engine, nxt, PARAMS).num_cached_tokens == 96
    off = make_engine(prefix_cache_last_full_page=False)
    generate(off, first, PARAMS)
    assert generate(off, nxt, PARAMS).num_cached_tokens == 0  # prompt end (99) and output end lie past it


# ---- eviction -------------------------------------------------------------------------------------


def test_a_sessions_older_checkpoints_go_before_another_live_sessions_newest(make_engine):
    rng = random.Random(2)
    engine = make_engine(num_checkpoint_slots=6)  # two turns of three checkpoints each
    b1, a1 = tokens(rng, 100), tokens(rng, 100)
    generate(engine, b1, PARAMS)  # session B: the least recent
    generate(engine, a1, PARAMS)  # session A, turn 1: page end 96, prompt end 99, end of output 102
    b_owner, a_owner = sorted({o for o, _ in positions(engine)})
    assert generate(engine, a1[:96] + tokens(rng, 40), PARAMS).num_cached_tokens == 96  # A, turn 2
    kept = positions(engine)
    assert [(o, p) for o, p in kept if o == b_owner] == [(b_owner, 96), (b_owner, 99), (b_owner, 102)]
    assert not [p for o, p in kept if o == a_owner]  # A's turn-1 checkpoints went (LRU would drop B's)


def test_a_checkpoint_two_requests_resumed_from_is_a_branch_point_and_stays(make_engine):
    rng = random.Random(3)
    engine = make_engine(num_checkpoint_slots=12)
    first = tokens(rng, 100)
    generate(engine, first, PARAMS)
    fork = next(c for c in engine.kv.prefix.checkpoints.ckpts.values() if c.p == 96)
    for _ in range(2):  # two subagents continuing from the same point
        assert generate(engine, first[:96] + tokens(rng, 30), PARAMS).num_cached_tokens == 96
    assert fork.resumed == 2 and not fork.superseded
    deeper = [c for c in engine.kv.prefix.checkpoints.ckpts.values() if c.owner == fork.owner and c.p > 96]
    assert deeper and all(c.superseded for c in deeper)  # the first turn's own ends were skipped


def test_a_running_requests_resume_point_is_never_evicted(make_engine):
    rng = random.Random(4)
    engine = make_engine(num_checkpoint_slots=3, prefix_cache_end_of_generation=False, max_num_seqs=2)
    engine.add_request("long", {"prompt_token_ids": tokens(rng, 40)}, SamplingParams(max_tokens=40, temperature=0))
    engine.step()  # its prefill: checkpoints at 32 (last full page) and 39 (prompt end)
    (owner,) = {o for o, _ in positions(engine)}
    for _ in range(3):  # short requests of other sessions need slots while it decodes
        generate(engine, tokens(rng, 50), PARAMS)
        assert (owner, 39) in positions(engine)  # the oldest, yet what it would resume from if preempted
    engine.abort_request("long")


def test_a_requests_newer_checkpoint_replaces_its_own_resume_point(make_engine):
    engine = make_engine(num_checkpoint_slots=1, prefix_cache_end_of_generation=False, prefix_cache_second_hit=False)
    generate(engine, tokens(random.Random(5), 100), PARAMS)
    assert [p for _, p in positions(engine)] == [99]  # 96 first, then 99 in its slot


@pytest.mark.parametrize("model", ["k3-tiny", "k3.1-tiny"])
def test_outputs_are_unchanged_by_the_eviction_order_under_pressure(make_engine, model):
    from prefix_cache_util import agent_workload

    ref = agent_workload(make_engine(model, enable_prefix_caching=False), sessions=6, turns=4)
    tight = agent_workload(make_engine(model, num_checkpoint_slots=4), sessions=6, turns=4)
    assert [o.outputs[0].token_ids for o in tight] == [o.outputs[0].token_ids for o in ref]
