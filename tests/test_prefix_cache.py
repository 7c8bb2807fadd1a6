"""Hybrid prefix caching (DESIGN.md §5, spec/serving.md §7): a hit resumes attention pages and the KDA
state at the same position, each retention policy creates the checkpoints it promises, and the output is
the same with the cache on or off. conftest's `make_engine` checks after every test that only pages
pinned by checkpoints stay referenced and every running slot came back."""

from __future__ import annotations

import random

from prefix_cache_util import agent_workload, batch, generate, tokens

from hyserve import SamplingParams

ONLY_PROMPT_END = dict(prefix_cache_second_hit=False, prefix_cache_end_of_generation=False,
                       prefix_cache_last_full_page=False)


def test_outputs_identical_on_and_off_over_an_agent_workload_with_eviction(make_engine):
    # small pools: 64 pages of 16 tokens and 6 checkpoint slots for 25 sessions of up to ~200 tokens
    small = dict(num_gpu_blocks=64, num_checkpoint_slots=6, max_num_seqs=13, max_num_batched_tokens=512)
    off = agent_workload(make_engine(enable_prefix_caching=False, **small))
    engine = make_engine(**small)
    on = agent_workload(engine)

    assert len(on) >= 200
    assert [o.outputs[0].token_ids for o in on] == [o.outputs[0].token_ids for o in off]
    pc = engine.kv.prefix
    assert pc.num_page_evictions > 0 and pc.checkpoints.num_evictions > 0
    # the counters are tokens actually skipped; a preempted request queries (and may hit) again
    assert engine.stats.prefix_cache_hits >= sum(o.num_cached_tokens for o in on) > 0
    assert engine.stats.prefix_cache_queries >= sum(len(o.prompt_token_ids) for o in on)
    if engine.scheduler.num_preemptions == 0:
        assert engine.stats.prefix_cache_hits == sum(o.num_cached_tokens for o in on)
        assert engine.stats.prompt_tokens == sum(len(o.prompt_token_ids) for o in on)
        assert engine.stats.prompt_tokens_cached == sum(o.num_cached_tokens for o in on)


def test_pool_is_empty_after_the_workload_except_checkpoint_tails(make_engine):
    engine = make_engine(num_gpu_blocks=64, num_checkpoint_slots=8)
    agent_workload(engine, sessions=6, turns=4)
    pc = engine.kv.prefix
    engine.kv.check_empty()
    assert pc.pinned_blocks, "non-aligned prompt-end checkpoints pin their tail pages"
    assert engine.kv.slots.num_free == engine.kv.slots.num_slots


def test_next_turn_hits_at_the_previous_prompt_end(make_engine):
    engine = make_engine(**ONLY_PROMPT_END)
    prompt = tokens(random.Random(1), 50)
    first = generate(engine, prompt)
    nxt = generate(engine, prompt + first.outputs[0].token_ids + [7, 8, 9])
    assert first.num_cached_tokens == 0
    assert nxt.num_cached_tokens == len(prompt) - 1  # the state after prompt_len - 1 tokens
    assert engine.stats.prefix_cache_hits == len(prompt) - 1


def test_an_identical_resend_hits_and_still_computes_one_token(make_engine):
    engine = make_engine(**ONLY_PROMPT_END)
    prompt = tokens(random.Random(2), 40)
    a, b = generate(engine, prompt), generate(engine, prompt)
    assert b.num_cached_tokens == len(prompt) - 1
    assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_interval_checkpoints_hit_at_the_last_interval_boundary(make_engine):
    rng = random.Random(3)
    prompt = tokens(rng, 50)
    diverging = prompt[:45] + tokens(rng, 15)  # shares 45 tokens: boundaries 16 and 32 lie inside
    with_interval = make_engine(prefix_cache_retention_interval=16, **ONLY_PROMPT_END)
    generate(with_interval, prompt)
    assert generate(with_interval, diverging).num_cached_tokens == 32
    without = make_engine(**ONLY_PROMPT_END)
    generate(without, prompt)
    assert generate(without, diverging).num_cached_tokens == 0


def test_interval_checkpoints_are_taken_during_decode_too(make_engine):
    engine = make_engine(prefix_cache_retention_interval=16, **ONLY_PROMPT_END)
    prompt = tokens(random.Random(4), 20)
    out = generate(engine, prompt, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    seq = prompt + out.outputs[0].token_ids
    assert generate(engine, seq[:35] + [1, 2, 3]).num_cached_tokens == 32


def _shared_system_prompt_hits(make_engine, second_hit: bool) -> list[int]:
    engine = make_engine(prefix_cache_second_hit=second_hit, prefix_cache_end_of_generation=False)
    rng = random.Random(5)
    system = tokens(rng, 40)
    # user messages start with distinct tokens, so the requests share exactly the system prompt
    return [generate(engine, system + [250 + i] + tokens(rng, 12)).num_cached_tokens for i in range(4)]


def test_a_shared_system_prompt_hits_from_its_third_request_with_second_hit_admission(make_engine):
    assert _shared_system_prompt_hits(make_engine, second_hit=True) == [0, 0, 40, 40]


def test_a_shared_system_prompt_never_hits_without_second_hit_admission(make_engine):
    assert _shared_system_prompt_hits(make_engine, second_hit=False) == [0, 0, 0, 0]


def test_second_hit_also_works_for_concurrent_requests(make_engine):
    engine = make_engine(prefix_cache_end_of_generation=False)
    rng = random.Random(6)
    system = tokens(rng, 40)
    batch(engine, [system + [250 + i] + tokens(rng, 12) for i in range(3)])
    assert generate(engine, system + [253] + tokens(rng, 9)).num_cached_tokens == 40


def test_end_of_generation_hits_on_an_exact_replay_of_prompt_and_output(make_engine):
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    prompt = tokens(random.Random(7), 30)
    for eog, expect in ((True, 30 + 10 - 1), (False, 30 - 1)):
        engine = make_engine(prefix_cache_second_hit=False, prefix_cache_end_of_generation=eog)
        out = generate(engine, prompt, params)
        replay = generate(engine, prompt + out.outputs[0].token_ids, params)
        assert replay.num_cached_tokens == expect


def test_a_partial_page_hit_restores_attention_and_recurrent_state_at_the_same_position(make_engine):
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    rng = random.Random(8)
    prompt = tokens(rng, 45)  # prompt-end checkpoint at 44 = 2 pages + 12 tokens of a third
    cont = prompt + tokens(rng, 30)
    ref = generate(make_engine(enable_prefix_caching=False), cont, params)
    engine = make_engine(**ONLY_PROMPT_END)
    generate(engine, prompt, params)
    hit = generate(engine, cont, params)
    assert hit.num_cached_tokens == 44 and 44 % 16 != 0
    assert hit.outputs[0].token_ids == ref.outputs[0].token_ids
    # the checkpoint was not written by the request that resumed from it
    again = generate(engine, cont, params)
    assert again.outputs[0].token_ids == ref.outputs[0].token_ids


def test_the_hit_falls_back_to_the_deepest_retained_checkpoint(make_engine):
    engine = make_engine(prefix_cache_retention_interval=16, **ONLY_PROMPT_END)
    rng = random.Random(9)
    prompt = tokens(rng, 70)
    generate(engine, prompt)  # checkpoints at 16, 32, 48, 64 and 69
    pc = engine.kv.prefix
    for c in [c for c in pc.checkpoints.ckpts.values() if c.p in (64, 69)]:  # lose the deepest ones
        pc.checkpoints.discard(c)
    assert generate(engine, prompt + [1, 2]).num_cached_tokens == 48


def test_cache_salt_isolates_tenants(make_engine):
    engine = make_engine(**ONLY_PROMPT_END)
    prompt = tokens(random.Random(10), 40)
    generate(engine, prompt, salt="tenant-a")
    assert generate(engine, prompt + [1], salt="tenant-b").num_cached_tokens == 0
    assert generate(engine, prompt + [1]).num_cached_tokens == 0
    assert generate(engine, prompt + [1], salt="tenant-a").num_cached_tokens == 39


def test_prompt_logprobs_requests_compute_every_position(make_engine):
    engine = make_engine(**ONLY_PROMPT_END)
    prompt = tokens(random.Random(11), 30)
    generate(engine, prompt)
    out = generate(engine, prompt + [3], SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=1))
    assert out.num_cached_tokens == 0 and len(out.prompt_logprobs) == 31


def test_checkpoint_eviction_weighs_flops_saved_per_byte_against_recency(make_engine):
    engine = make_engine(num_checkpoint_slots=3, **ONLY_PROMPT_END)
    rng = random.Random(12)
    for n in (200, 20, 100):  # checkpoints at 199 (oldest), 19 (cheap), 99
        generate(engine, tokens(rng, n))
    generate(engine, tokens(rng, 30))  # needs a slot: LRU would drop 199; 19 saves the least per byte
    assert sorted(c.p for c in engine.kv.prefix.checkpoints.ckpts.values()) == [29, 99, 199]


def test_start_up_log_reports_capacities_and_the_effective_mode(make_engine, caplog):
    with caplog.at_level("INFO", logger="hyserve.engine.prefix_cache"):
        make_engine(prefix_cache_retention_interval=64, num_checkpoint_slots=5)
    line = next(r.getMessage() for r in caplog.records if r.name == "hyserve.engine.prefix_cache")
    assert "page granularity 16 tokens" in line and "5 checkpoint slots" in line
    assert "every 64 tokens" in line and "second-hit" in line and "end of generation" in line


def test_an_aborted_request_leaves_a_checkpoint_where_it_stopped(make_engine):
    engine = make_engine(max_num_batched_tokens=32, **dict(ONLY_PROMPT_END, prefix_cache_end_of_generation=True))
    prompt = tokens(random.Random(13), 100)
    engine.add_request("a", {"prompt_token_ids": prompt}, SamplingParams(max_tokens=4))
    engine.step()
    engine.step()  # 64 tokens computed, then the client goes away
    engine.abort_request("a")
    assert generate(engine, prompt + [1]).num_cached_tokens == 64


def test_preempted_requests_resume_from_their_own_checkpoint_with_identical_outputs(make_engine):
    rng = random.Random(14)
    prompts = [tokens(rng, 120) for _ in range(3)]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    ref = batch(make_engine(enable_prefix_caching=False), prompts, params)
    # three requests of 10 pages cannot all run; the others' growth evicts the victim's freed pages, so
    # it resumes through the CPU tier (without one it would recompute, which is also correct)
    engine = make_engine(num_gpu_blocks=24, cpu_offload_bytes=4 << 20)
    outs = batch(engine, prompts, params)
    assert engine.scheduler.num_preemptions > 0
    assert engine.stats.prefix_cache_hits > 0  # the resumed request skipped what it had computed
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
