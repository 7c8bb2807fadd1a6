"""The draft budget of DSpark drafting (hyserve/spec_decode/engine_dspark.py), on the CPU: a drafter whose drafts
never pass turns itself down (no drafter forward, no verify step, no per-step context call) and the output stays
plain decoding's; one that is always right keeps drafting; `confidence_threshold` 0 verifies every draft; the
context rows deferred while nobody drafts are the rows an always-flushing run computes."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from test_spec_engine import launches_overlapped, repetitive_prompts, run

from hyserve import SamplingParams
from hyserve.spec_decode import engine_dspark
from hyserve.spec_decode.draft_budget import STEP_OVERHEAD_S, step_seconds
from hyserve.spec_decode.engine_step import target_step_cost

LONG = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
KW = dict(enable_prefix_caching=False)


def dspark(drafter_dir: str, **extra) -> dict:
    return {"method": "dspark", "model": drafter_dir, **extra}


@dataclass
class Drafted:
    forwards: list[int] = field(default_factory=list)  # requests of each drafter forward
    contexts: dict[tuple[tuple[int, ...], int], list[torch.Tensor]] = field(default_factory=dict)
    context_calls: int = 0  # drafter calls that computed context rows


def judged(llm, prompts, plain, right: bool = False) -> Drafted:
    """Every block the drafter drafts is replaced by the plain run's next tokens (`right`) or by tokens the
    target never emits there (each one + 1): every draft is accepted, or every verify step rejects its first.
    Records each drafter forward, the drafting requests' context rows at that point (by prompt and position)
    and the drafter's context-row calls."""
    engine, proposer, seen = llm.engine, llm.engine.spec.proposer, Drafted()
    refs, vocab = {tuple(p): o for p, o in zip(prompts, plain)}, engine.model_config.vocab_size
    propose, context_rows = proposer.propose, proposer.drafter.context_rows

    def drafted(req_ids, anchors, temps=None, gens=None):
        block = propose(req_ids, anchors, temps, gens)
        seen.forwards.append(len(req_ids))
        reqs = {r.request_id: r for r in engine.scheduler.running}
        for i, rid in enumerate(req_ids):
            r = reqs[rid]
            key = (tuple(r.prompt_token_ids), proposer.num_context(rid))
            seen.contexts[key] = [v.clone() for v in proposer.stores[rid].views()]
            nxt = refs[key[0]][len(r.output_token_ids) :][: block.token_ids.shape[1]]
            block.token_ids[i, : len(nxt)] = torch.tensor([t if right else (t + 1) % vocab for t in nxt])
        return block

    def counted(*args):
        seen.context_calls += 1
        return context_rows(*args)

    proposer.propose, proposer.drafter.context_rows = drafted, counted
    return seen


def turned_down_steps(llm, seen: Drafted) -> list[int]:
    """A list that gets, for every step executed while no running request may draft, the context-row calls
    made during it."""
    decoder, steps = llm.engine.spec, []
    execute = decoder.execute

    def spied(runner, out, pending):
        down, before = not decoder.may_draft(llm.engine.scheduler.running), seen.context_calls
        logits = execute(runner, out, pending)
        if down:
            steps.append(seen.context_calls - before)
        return logits

    decoder.execute = spied
    return steps


@pytest.fixture(scope="module")
def prompts():
    return repetitive_prompts(3, seed=5)


@pytest.fixture
def plain(make_llm, prompts):
    return run(make_llm(**KW), prompts, LONG)


def test_a_drafter_whose_drafts_never_pass_turns_drafting_down_and_keeps_the_output(make_llm, drafter_dir,
                                                                                   prompts, plain):
    llm = make_llm(speculative_config=dspark(drafter_dir), **KW)
    seen = judged(llm, prompts, plain)
    assert run(llm, prompts, LONG) == plain
    st, outputs = llm.engine.stats.spec_decode, sum(map(len, plain))
    # one miss each until the rates fall, then a retry some tens of steps later
    assert st.num_accepted_tokens == 0 and 0 < st.num_drafts <= 15 and outputs == 3 * 60
    assert 0 < len(seen.forwards) <= 10


def test_a_drafter_that_is_always_right_drafts_every_step(make_llm, drafter_dir, prompts, plain):
    llm = make_llm(speculative_config=dspark(drafter_dir), **KW)
    judged(llm, prompts, plain, right=True)
    assert run(llm, prompts, LONG) == plain
    st = llm.engine.stats.spec_decode
    k = llm.engine.spec.proposer.k
    assert st.num_accepted_tokens == st.num_draft_tokens > 0
    assert st.num_draft_tokens >= k * (st.num_drafts - len(prompts))  # full blocks but at each request's end


def test_a_confidence_threshold_of_zero_verifies_every_draft_without_a_budget(make_llm, drafter_dir, prompts, plain):
    llm = make_llm(speculative_config=dspark(drafter_dir, confidence_threshold=0), **KW)
    assert llm.engine.spec.budget is None
    judged(llm, prompts, plain)
    assert run(llm, prompts, LONG) == plain
    st = llm.engine.stats.spec_decode
    # each verify step emits one token: all but each request's first (its prefill's) and last (no room)
    assert st.num_accepted_tokens == 0 and st.num_drafts >= sum(map(len, plain)) - 2 * len(prompts)


def test_turned_down_steps_defer_the_context_rows_and_drafting_computes_the_always_flushing_rows(
        make_llm, drafter_dir, prompts, plain, monkeypatch):
    """The same steps with and without deferring (a deferred-row limit of 0 computes the rows every step):
    no context call in a turned-down step, and the rows a resumed drafting reads are the ones computed
    step by step (up to the drafter calls' batching)."""
    llm = make_llm(speculative_config=dspark(drafter_dir), **KW)
    seen = judged(llm, prompts, plain)
    steps = turned_down_steps(llm, seen)
    assert run(llm, prompts, LONG) == plain
    assert len(steps) > 30 and not any(steps)
    proposer = llm.engine.spec.proposer
    assert proposer.queued_rows == 0 and proposer.stores == {}  # finished requests dropped their queue
    monkeypatch.setattr(engine_dspark, "MAX_DEFERRED_ROWS", 0)
    always = make_llm(speculative_config=dspark(drafter_dir), **KW)
    want = judged(always, prompts, plain)
    flushed = turned_down_steps(always, want)
    assert run(always, prompts, LONG) == plain
    assert len(flushed) == len(steps) and all(flushed)
    assert seen.contexts.keys() == want.contexts.keys()
    retries = [key for key in seen.contexts if key[1] > min(n for p, n in seen.contexts if p == key[0])]
    assert retries  # drafting resumed after deferred steps
    for key, rows in seen.contexts.items():
        for got, ref in zip(rows, want.contexts[key], strict=True):
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


def test_deferred_context_rows_are_computed_once_too_many_wait(make_llm, drafter_dir, prompts, plain, monkeypatch):
    monkeypatch.setattr(engine_dspark, "MAX_DEFERRED_ROWS", 8)
    llm = make_llm(speculative_config=dspark(drafter_dir), **KW)
    seen = judged(llm, prompts, plain)
    steps, proposer, queued = turned_down_steps(llm, seen), llm.engine.spec.proposer, []
    execute = llm.engine.spec.execute

    def spied(*args):
        logits = execute(*args)
        queued.append(proposer.queued_rows)
        return logits

    llm.engine.spec.execute = spied
    assert run(llm, prompts, LONG) == plain
    assert 0 < sum(steps) < len(steps) // 2 and max(queued) <= 8


def test_freeing_a_request_drops_its_queued_rows(tiny_model, drafter_dir):
    from hyserve.spec_decode.dspark_io import load_drafter
    from hyserve.spec_decode.dspark_propose import DSparkProposer

    target, _ = tiny_model("k3-tiny")
    proposer = DSparkProposer(load_drafter(drafter_dir, target))
    width = proposer.drafter.fc.in_features
    proposer.add_context("a", torch.randn(3, width), torch.arange(3))
    proposer.add_context("b", torch.randn(2, width), torch.arange(2))
    assert proposer.queued_rows == 5
    proposer.free("a")
    assert proposer.queued_rows == 2
    proposer.flush()
    assert proposer.queued_rows == 0 and list(proposer.rows) == ["b"] and proposer.rows["b"][0].shape[0] == 2


def test_steps_overlap_again_once_the_dspark_budget_turns_every_request_down(make_llm, drafter_dir):
    """Async scheduling: once no request's drafts could pay, the engine does not wait for a step's tokens to
    draft, as for n-gram drafts."""
    prompts = repetitive_prompts(2, seed=6)
    plain = run(make_llm(async_scheduling=True, **KW), prompts, LONG)
    llm = make_llm(async_scheduling=True, speculative_config=dspark(drafter_dir), **KW)
    judged(llm, prompts, plain)
    overlapped = launches_overlapped(llm.engine)
    assert run(llm, prompts, LONG) == plain
    assert not any(overlapped[:3]) and sum(overlapped[-20:]) >= 15


def test_the_drafting_bytes_are_the_drafters_weights_but_the_markov_table_plus_the_shared_lm_head(tiny_model,
                                                                                               drafter_dir):
    from hyserve.spec_decode.dspark_io import load_drafter

    target, _ = tiny_model("k3-tiny")
    drafter = load_drafter(drafter_dir, target)
    own = sum(p.numel() for p in drafter.parameters()) - drafter.markov_in.weight.numel()
    assert drafter.drafting_bytes() == 4 * (own + target.lm_head.weight.numel())  # float32


def test_a_dspark_verify_step_is_costed_with_one_drafting_call(make_llm, drafter_dir):
    llm = make_llm(speculative_config=dspark(drafter_dir), **KW)
    decoder = llm.engine.spec
    weight_bytes, copy = target_step_cost(decoder.model)
    target = step_seconds(weight_bytes, copy)
    drafting = decoder.proposer.drafter.drafting_bytes() / copy + STEP_OVERHEAD_S
    assert decoder.budget.seconds(5, True) == pytest.approx(target(5, True) + drafting)
    assert decoder.budget.seconds(5, False) == target(5, False)
