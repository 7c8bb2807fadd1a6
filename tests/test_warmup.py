"""The warm start (hyserve/planning/warmup.py): at engine start the prefill and mixed-step shapes of the
token-count ladder run through the real forward on lent cache rows; afterwards the pools are as they
were and every output is what an engine without the warm-up gives."""

from __future__ import annotations

import contextlib

import pytest
from prefix_cache_util import batch

from hyserve import SamplingParams
from hyserve.planning.warmup import FLA_L2NORM_ROWS, plan_warmup, prefill_tokens, token_ladder

BUDGET = 64  # a small ladder: 2, 4, ..., 64 tokens


@contextlib.contextmanager
def recorded_forwards(model):
    """(query_lens, context_lens) of every forward of `model` inside the block."""
    seen: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    hook = model.register_forward_pre_hook(lambda _m, args: seen.append((tuple(args[1].query_lens),
                                                                          tuple(args[1].context_lens))))
    try:
        yield seen
    finally:
        hook.remove()


def engine_pair(make_engine, model: str, **kwargs):
    kwargs.setdefault("max_num_batched_tokens", BUDGET)
    kwargs.setdefault("max_num_seqs", 8)
    return make_engine(model, warmup=False, **kwargs), make_engine(model, warmup=True, **kwargs)


@pytest.mark.parametrize("model", ["k3-tiny", "k3.1-tiny"])
def test_outputs_are_identical_with_and_without_the_warmup(make_engine, model):
    prompts = [[(5 * i + 3 * j) % 200 + 1 for j in range(n)] for i, n in enumerate((3, 40, 90, 17))]
    results = []
    for warmup in (False, True):  # one at a time: each engine seeds torch's generator when it is built
        engine = make_engine(model, warmup=warmup, max_num_batched_tokens=BUDGET, max_num_seqs=8)
        greedy = batch(engine, prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
        sampled = batch(engine, prompts, SamplingParams(max_tokens=6, temperature=1.0, ignore_eos=True))
        results.append([o.outputs[0].token_ids for o in greedy + sampled])
    assert results[0] == results[1]


@pytest.mark.parametrize("model", ["k3-tiny", "k3.1-tiny"])
def test_the_pools_are_as_they_were_after_the_warmup(make_engine, model):
    cold, warm = engine_pair(make_engine, model)
    warm.kv.check_empty()
    assert warm.kv.pool_stats == cold.kv.pool_stats
    # the same pages and slots in the same order: the next requests get exactly what they would have
    assert list(warm.kv.blocks.free_queue) == list(cold.kv.blocks.free_queue)
    assert warm.kv.slots.free_slots == cold.kv.slots.free_slots
    assert warm.kv.prefix_stats == (0, 0) and not warm.kv.prefix.pinned_blocks


@pytest.mark.parametrize("model", ["k3-tiny", "k3.1-tiny"])
def test_the_warmup_runs_exactly_the_planned_ladder_and_shows_its_progress(make_engine, tiny_model, model, caplog):
    weights, _ = tiny_model(model)
    cold = make_engine(model, warmup=False, max_num_batched_tokens=BUDGET, max_num_seqs=8)
    plan = plan_warmup(cold.cfg, cold.max_model_len, cold.kv, decode_graphs=False)
    with recorded_forwards(weights) as seen, caplog.at_level("INFO", logger="hyserve.planning.warmup"):
        warm = make_engine(model, warmup=True, max_num_batched_tokens=BUDGET, max_num_seqs=8)
    assert seen == [(s.query_lens, s.context_lens) for s in plan]
    assert "warm-up" in warm.startup.phases
    progress = [r.getMessage() for r in caplog.records if r.name == "hyserve.planning.warmup"]
    assert len(progress) == len(token_ladder(BUDGET)) + 1  # one line per token count, one for the eager decodes
    assert progress[-1].startswith(f"warm-up: eager decodes done ({len(plan)}/{len(plan)} steps")


def test_the_ladder_covers_every_token_count_with_and_without_decodes_and_cached_context(make_engine):
    engine = make_engine(warmup=False, max_num_batched_tokens=48, max_num_seqs=8)
    plan = plan_warmup(engine.cfg, engine.max_model_len, engine.kv, decode_graphs=True)
    assert token_ladder(48) == [2, 4, 8, 16, 32, 48]
    for t in token_ladder(48):
        steps = [s for s in plan if s.rung == t]
        assert all(s.num_tokens == t for s in steps if s.label != f"prefill {t - 1}")
        assert ((t,), (t,)) in [(s.query_lens, s.context_lens) for s in steps]  # a fresh prefill
        if t >= 4:  # and the odd one prefix caching computes first of a t-token prompt
            assert ((t - 1,), (t - 1,)) in [(s.query_lens, s.context_lens) for s in steps]
        assert any(len(s.query_lens) == 1 and s.context_lens[0] > t for s in steps)  # over a cached context
        if t >= 4:  # a chunk of at least two tokens beside decodes, one of them over a long context
            mixed = [s for s in steps if len(s.query_lens) > 1]
            assert mixed and all(s.query_lens[0] >= 2 and set(s.query_lens[1:]) == {1} for s in mixed)
            assert max(s.context_lens[1] for s in mixed) == engine.max_model_len
            assert max(len(s.query_lens) for s in mixed) == min(8, t // 2 + 1)
    assert not [s for s in plan if s.rung == 0]  # decode-only steps are left to the graph capture


def test_the_warmup_reaches_every_l2norm_bucket_a_step_of_the_budget_can_fall_in(make_engine):
    # heads such that fla's L2-norm bucket is ceil(tokens / 8): the ladder up to 48 reaches buckets
    # 1, 2, 4 and 6 (16, 32, 48 tokens and the steps beside them), not 3 or 5
    engine = make_engine(warmup=False, max_num_batched_tokens=48, max_num_seqs=8)
    heads = FLA_L2NORM_ROWS // 8
    plan = plan_warmup(engine.cfg, engine.max_model_len, engine.kv, decode_graphs=True, kda_heads=heads)
    without = plan_warmup(engine.cfg, engine.max_model_len, engine.kv, decode_graphs=True)
    bucket = lambda s: -(-prefill_tokens(s) // 8)  # noqa: E731
    assert {bucket(s) for s in without} - {0} == {1, 2, 4, 6}
    assert {bucket(s) for s in plan} - {0} == {1, 2, 3, 4, 5, 6}
    extra = [s for s in plan if s not in without]
    assert [(s.query_lens, s.context_lens) for s in extra] == [((24,), (24,)), ((40,), (40,))]  # each bucket's largest


def test_without_kda_heads_the_plan_has_no_l2norm_bucket_steps(make_engine):
    engine = make_engine(warmup=False, max_num_batched_tokens=48, max_num_seqs=8)
    assert plan_warmup(engine.cfg, engine.max_model_len, engine.kv, True, kda_heads=0) == \
        plan_warmup(engine.cfg, engine.max_model_len, engine.kv, True)


def test_without_decode_graphs_the_ladder_adds_eager_decode_steps(make_engine):
    engine = make_engine(warmup=False, max_num_batched_tokens=48, max_num_seqs=8)
    plan = plan_warmup(engine.cfg, engine.max_model_len, engine.kv, decode_graphs=False)
    decodes = [s for s in plan if s.rung == 0]
    assert sorted({len(s.query_lens) for s in decodes}) == [1, 2, 4, 8]
    assert all(set(s.query_lens) == {1} for s in decodes)


def test_the_ladder_stays_within_max_model_len_and_the_lendable_pages(make_engine):
    engine = make_engine(warmup=False, max_num_batched_tokens=64, max_num_seqs=4, max_model_len=40, num_gpu_blocks=2)
    plan = plan_warmup(engine.cfg, engine.max_model_len, engine.kv, decode_graphs=True)
    assert plan and max(max(s.context_lens) for s in plan) <= 32  # 2 pages of 16 tokens
    assert max(len(s.query_lens) for s in plan) <= 4
    assert [s for s in plan if s.rung == 64][0].query_lens == (32, 32)  # a 64-token prefill over two sequences


def test_one_sequence_engines_warm_up_without_mixed_steps(make_engine):
    # a mixed step holds the chunk's sequence beside the decodes: it needs two state slots
    engine = make_engine(warmup=False, max_num_batched_tokens=48, max_num_seqs=1)
    for graphs in (True, False):
        plan = plan_warmup(engine.cfg, engine.max_model_len, engine.kv, decode_graphs=graphs)
        assert plan and max(len(s.query_lens) for s in plan) == 1
    warm = make_engine(warmup=True, max_num_batched_tokens=48, max_num_seqs=1)
    warm.kv.check_empty()


def test_the_warmup_is_on_by_default_for_cuda_only():
    from hyserve.config import EngineConfig, resolve_config

    assert resolve_config(EngineConfig(), "cuda:0", "bfloat16").warmup is True
    assert resolve_config(EngineConfig(), "cpu", "float32").warmup is False
    assert resolve_config(EngineConfig(warmup=False), "cuda", "bfloat16").warmup is False


SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
        "confidence_threshold": 0}  # every draft verified: the verify steps, not the budget, are under test


def test_a_speculating_engine_warms_up_verify_rows_of_every_draft_count(make_engine):
    engine = make_engine(warmup=False, max_num_batched_tokens=48, max_num_seqs=8, speculative_config=SPEC)
    plan = plan_warmup(engine.cfg, engine.max_model_len, engine.kv, decode_graphs=True)
    verify = [s for s in plan if s.drafts]
    assert sorted({s.drafts for s in verify}) == [1, 2, 3]
    for k in (1, 2, 3):
        rows = [s for s in verify if s.drafts == k]
        assert all(set(s.query_lens) == {1 + k} for s in rows)
        assert {len(s.query_lens) for s in rows} == {1, 8}  # one sequence and the most the slots allow
        assert max(s.context_lens[0] for s in rows) == engine.max_model_len
    assert not [s for s in plan_warmup(engine.cfg, engine.max_model_len, engine.kv, True) if s.drafts and
                len(s.query_lens) * engine.kv.spec_width > engine.kv.slots.num_free]
    plain = make_engine(warmup=False, max_num_batched_tokens=48, max_num_seqs=8)
    assert not [s for s in plan_warmup(plain.cfg, plain.max_model_len, plain.kv, True) if s.drafts]


def test_the_verify_warmup_runs_the_planned_rows_and_leaves_pools_and_outputs_as_they_were(make_engine, tiny_model):
    weights, _ = tiny_model("k3-tiny")
    kw = dict(max_num_batched_tokens=48, max_num_seqs=4, speculative_config=SPEC)
    cold = make_engine(warmup=False, **kw)
    plan = plan_warmup(cold.cfg, cold.max_model_len, cold.kv, decode_graphs=False)
    verified: list[bool] = []
    hook = weights.register_forward_pre_hook(lambda _m, args: verified.append(args[1].verify is not None))
    with recorded_forwards(weights) as seen:
        warm = make_engine(warmup=True, **kw)
    hook.remove()
    assert seen == [(s.query_lens, s.context_lens) for s in plan]
    assert verified == [bool(s.drafts) for s in plan] and any(verified)  # verify rows, not prompt chunks
    warm.kv.check_empty()
    assert list(warm.kv.blocks.free_queue) == list(cold.kv.blocks.free_queue)
    assert warm.kv.slots.free_slots == cold.kv.slots.free_slots
    prompts = [([7, 8, 9] * 9)[:n] for n in (10, 25)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in batch(warm, prompts, params)] == \
        [o.outputs[0].token_ids for o in batch(cold, prompts, params)]
    assert warm.stats.spec_decode.num_drafts > 0
