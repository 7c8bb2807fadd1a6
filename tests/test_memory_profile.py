"""The profile run (hyserve/planning/memory_profile.py): the engine's largest steps, run before the cache is
sized, on a small cache of their own; the cache budget leaves their peak out. The measurement itself needs
CUDA (tests/gpu/test_memory_profile_gpu.py); these check which steps run and what the plan does with it."""

from __future__ import annotations

import pytest

from hyserve.engine.kv_cache import device_cache_budget
from hyserve.ops.mla_decode import MAX_EXPANDED_ROWS
from hyserve.planning.memory_profile import (
    _small_cache,
    profile_contexts,
    profile_memory,
    profile_steps,
    sampler_rows,
)
from hyserve.planning.warmup import run_steps

BUDGET = 64


def test_the_profiled_steps_include_a_fresh_prefill_of_the_whole_token_budget(make_engine):
    engine = make_engine("k3-tiny", warmup=False, max_num_batched_tokens=BUDGET, max_num_seqs=4)
    kv = _small_cache(engine.cfg, engine.model, engine.model.dtype, engine.max_model_len)
    steps = profile_steps(engine.cfg, kv, engine.max_model_len)
    fresh = [s for s in steps if s.query_lens == s.context_lens]
    assert max(s.num_tokens for s in fresh) == BUDGET


def test_the_profiled_steps_include_a_chunk_of_the_budget_over_a_cached_context(make_engine):
    engine = make_engine("k3-tiny", warmup=False, max_num_batched_tokens=BUDGET, max_num_seqs=4)
    kv = _small_cache(engine.cfg, engine.model, engine.model.dtype, engine.max_model_len)
    steps = profile_steps(engine.cfg, kv, engine.max_model_len)
    assert any(s.query_lens == (BUDGET,) and s.context_lens == (2 * BUDGET,) for s in steps)


def test_the_profiled_steps_include_a_chunk_at_the_end_of_the_longest_expanded_context(make_engine):
    engine = make_engine("k3-tiny", warmup=False, max_num_batched_tokens=BUDGET, max_num_seqs=4)
    kv = _small_cache(engine.cfg, engine.model, engine.model.dtype, engine.max_model_len)
    longest = min(engine.max_model_len, MAX_EXPANDED_ROWS)
    assert 2 * BUDGET < longest
    assert any(s.query_lens == (BUDGET,) and s.context_lens == (longest,)
               for s in profile_steps(engine.cfg, kv, engine.max_model_len))


def test_a_speculating_engine_profiles_its_largest_verify_step(make_engine):
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    engine = make_engine("k3-tiny", warmup=False, max_num_batched_tokens=BUDGET, max_num_seqs=4,
                         speculative_config=spec)
    kv = _small_cache(engine.cfg, engine.model, engine.model.dtype, engine.max_model_len)
    verify = [s for s in profile_steps(engine.cfg, kv, engine.max_model_len) if s.drafts]
    assert len(verify) == 1
    assert verify[0].drafts == 3 and verify[0].query_lens == (4,) * 4


def test_the_small_cache_holds_exactly_what_the_profiled_steps_take(make_engine):
    engine = make_engine("k3-tiny", warmup=False, max_num_batched_tokens=BUDGET, max_num_seqs=4,
                         speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    longest, seqs, _ = profile_contexts(engine.cfg, engine.max_model_len, engine.cfg.block_size)
    kv = _small_cache(engine.cfg, engine.model, engine.model.dtype, engine.max_model_len)
    assert kv.blocks.num_free * kv.block_size >= longest > (kv.blocks.num_free - 1) * kv.block_size
    assert kv.slots.num_free == seqs * 4


def test_the_profiled_steps_run_on_the_small_cache_and_give_back_every_page_and_slot(make_engine):
    engine = make_engine("k3-tiny", warmup=False, max_num_batched_tokens=BUDGET, max_num_seqs=4,
                         speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    kv = _small_cache(engine.cfg, engine.model, engine.model.dtype, engine.max_model_len)
    before = (kv.blocks.num_free, kv.slots.num_free)
    run_steps(engine.model, kv, profile_steps(engine.cfg, kv, engine.max_model_len), name="memory profile")
    assert (kv.blocks.num_free, kv.slots.num_free) == before


def test_the_sampler_is_profiled_over_every_verify_row_within_the_token_budget(make_engine):
    engine = make_engine("k3-tiny", warmup=False, max_num_batched_tokens=BUDGET, max_num_seqs=4,
                         speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    assert sampler_rows(engine.cfg) == 16
    capped = make_engine("k3-tiny", warmup=False, max_num_batched_tokens=BUDGET, max_num_seqs=40)
    assert sampler_rows(capped.cfg) == 40
    tight = make_engine("k3-tiny", warmup=False, max_num_batched_tokens=BUDGET, max_num_seqs=40,
                        speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    assert sampler_rows(tight.cfg) == BUDGET


def test_no_profile_runs_off_cuda(make_engine):
    engine = make_engine("k3-tiny", warmup=False, max_num_batched_tokens=BUDGET, kv_cache_memory_bytes=None)
    assert profile_memory(engine.cfg, engine.model, engine.model.dtype, engine.max_model_len) is None


GIB = 1 << 30


def test_the_cache_budget_leaves_out_the_margin_and_the_profiled_peak():
    # 80 GiB card, 45 GiB in use after loading, 0.9 utilization: 27 GiB less a 3 GiB peak
    assert device_cache_budget(free=35 * GIB, total=80 * GIB, utilization=0.9, activation_bytes=3 * GIB) == 24 * GIB


@pytest.mark.parametrize("peak", [0, GIB])
def test_the_cache_budget_without_a_peak_is_the_old_margin_rule(peak):
    without = device_cache_budget(free=35 * GIB, total=80 * GIB, utilization=0.9, activation_bytes=0)
    assert without == 27 * GIB
    assert device_cache_budget(free=35 * GIB, total=80 * GIB, utilization=0.9, activation_bytes=peak) == without - peak
