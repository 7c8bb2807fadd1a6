"""The CPU tier of the prefix cache: evicted pages and checkpoints land there, a hit restores from it with
identical outputs, and a lookup takes the longer hit of the two tiers."""

from __future__ import annotations

import random

from prefix_cache_util import generate, tokens

from hyserve import SamplingParams

PARAMS = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
# one checkpoint slot and 20 pages: every new prompt pushes the previous checkpoint and pages out
TIGHT = dict(num_checkpoint_slots=1, num_gpu_blocks=20, prefix_cache_second_hit=False,
             prefix_cache_end_of_generation=False, prefix_cache_last_full_page=False, cpu_offload_bytes=8 << 20)


def test_a_checkpoint_restored_from_the_cpu_tier_gives_identical_outputs(make_engine):
    rng = random.Random(0)
    prompt, other = tokens(rng, 150), tokens(rng, 150)
    cont = prompt + tokens(rng, 20)
    ref = generate(make_engine(enable_prefix_caching=False), cont, PARAMS)

    engine = make_engine(**TIGHT)
    generate(engine, prompt, PARAMS)
    generate(engine, other, PARAMS)  # evicts prompt's checkpoint and its pages
    pc = engine.kv.prefix
    assert pc.checkpoints.num_evictions == 1 and pc.cpu.ckpts_out == 1 and pc.cpu.pages_out > 0

    hit = generate(engine, cont, PARAMS)
    assert hit.num_cached_tokens == 149 and pc.cpu_hits == 149
    assert pc.cpu.pages_in > 0  # the attention pages came back from the CPU too
    assert hit.outputs[0].token_ids == ref.outputs[0].token_ids


def test_without_the_cpu_tier_the_same_eviction_loses_the_hit(make_engine):
    rng = random.Random(0)
    prompt, other = tokens(rng, 150), tokens(rng, 150)
    engine = make_engine(**dict(TIGHT, cpu_offload_bytes=0))
    generate(engine, prompt, PARAMS)
    generate(engine, other, PARAMS)
    assert generate(engine, prompt + [1, 2], PARAMS).num_cached_tokens == 0


def test_the_longer_cpu_hit_wins_over_a_shorter_gpu_hit(make_engine):
    x = tokens(random.Random(1), 100)
    engine = make_engine(**dict(TIGHT, num_gpu_blocks=64))
    generate(engine, x[:80], PARAMS)  # checkpoint at 79 (GPU)
    generate(engine, x[:41], PARAMS)  # checkpoint at 40 (GPU), pushes 79 to the CPU
    pc = engine.kv.prefix
    assert [c.p for c in pc.checkpoints.ckpts.values()] == [40] and [c.p for c in pc.cpu.ckpts.values()] == [79]
    ref = generate(make_engine(enable_prefix_caching=False), x, PARAMS)
    hit = generate(engine, x, PARAMS)
    assert hit.num_cached_tokens == 79 and pc.cpu_hits == 79
    assert hit.outputs[0].token_ids == ref.outputs[0].token_ids


def test_the_longer_gpu_hit_wins_over_a_shorter_cpu_hit(make_engine):
    x = tokens(random.Random(2), 100)
    engine = make_engine(**dict(TIGHT, num_gpu_blocks=64))
    generate(engine, x[:41], PARAMS)  # checkpoint at 40
    generate(engine, x[:80], PARAMS)  # hits 40, checkpoints 79, pushes 40 to the CPU
    pc = engine.kv.prefix
    assert [c.p for c in pc.checkpoints.ckpts.values()] == [79] and [c.p for c in pc.cpu.ckpts.values()] == [40]
    assert generate(engine, x, PARAMS).num_cached_tokens == 79 and pc.cpu_hits == 0


def test_pages_evicted_in_one_allocation_leave_in_one_batch(make_engine):
    engine = make_engine(**dict(TIGHT, num_gpu_blocks=12))  # the next prompt must evict most pages
    generate(engine, tokens(random.Random(3), 150), PARAMS)
    cpu = engine.kv.prefix.cpu
    before = cpu.pages_out
    calls = []
    real = cpu.put_pages
    cpu.put_pages = lambda hashes, data: (calls.append(len(hashes)), real(hashes, data))
    generate(engine, tokens(random.Random(4), 150), PARAMS)
    assert cpu.pages_out > before
    assert sum(calls) == cpu.pages_out - before
    assert len(calls) < sum(calls)  # the prefill chunk's evictions went out together
