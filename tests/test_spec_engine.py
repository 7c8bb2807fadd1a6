"""Speculative decoding through the engine (docs/speculative_decoding.md §2, §4), on the CPU: greedy output
identical with and without speculation, exact rollback of the KDA state, the four regressions other
engines shipped, metrics and the synthetic acceptance mode. `make_engine` checks after every test that no
page or state slot is still held."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import assert_pool_empty

from hyserve import SamplingParams
from hyserve.config import EngineConfig
from hyserve.engine.request import RequestStatus
from hyserve.engine.scheduler import ScheduledSeq, SchedulerOutput
from hyserve.engine.step_inputs import build_step_inputs

K = 3
# every draft verified (no draft budget): these tests judge the verify path itself, step by step
NGRAM = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "confidence_threshold": 0}
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


class Oracle:
    """A drafter that knows the plain run's outputs: its drafts are right up to a position that varies
    from step to step (every draft, some, none), so verify steps accept and reject. `wrong` makes every
    draft wrong; `dry_after` proposes nothing once a request has that many outputs."""

    def __init__(self, refs: dict[tuple[int, ...], list[int]], wrong: bool = False, dry_after: int | None = None):
        self.refs, self.wrong, self.dry_after, self.calls = refs, wrong, dry_after, 0

    def __len__(self) -> int:  # keeps no per-request index
        return 0

    def propose(self, histories, keys=None):
        out = []
        for h in histories:
            h = h[:]  # a TokenHistory reads as a list
            self.calls += 1
            prompt = next(p for p in self.refs if tuple(h[: len(p)]) == p and len(h) >= len(p))
            done, ref = len(h) - len(prompt), self.refs[prompt]
            if self.dry_after is not None and done >= self.dry_after:
                out.append([])
                continue
            drafts = list(ref[done : done + K])
            good = 0 if self.wrong else self.calls % (K + 1)  # 0..K drafts right
            out.append([t if j < good else (t + 1) % 256 for j, t in enumerate(drafts)])
        return out


def repetitive_prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        motif = [rng.randrange(256) for _ in range(rng.randint(2, 5))]
        out.append((motif * 12)[: rng.randint(9, 40)])
    return out


def run(llm, prompts, params=GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


STRESS = dict(max_num_batched_tokens=12, block_size=4, num_gpu_blocks=20, async_scheduling=True,
              prefix_cache_retention_interval=8)


@pytest.mark.parametrize("model", ["k3-tiny", "kimi-linear-tiny", "k3.1-tiny"])
def test_greedy_output_is_identical_with_speculation(make_llm, model):
    """Mixed batch, prefix caching, chunked prefill (a 12-token budget), preemption (20 pages of 4 tokens)
    and async scheduling: the oracle's drafts are accepted and rejected, the output never changes."""
    prompts = repetitive_prompts(5) + [repetitive_prompts(1, 7)[0]] * 2  # a repeat hits the prefix cache
    plain = run(make_llm(model, **STRESS), prompts)
    llm = make_llm(model, speculative_config=NGRAM, **STRESS)
    llm.engine.spec.proposer = Oracle({tuple(p): o for p, o in zip(prompts, plain)})
    assert run(llm, prompts) == plain
    st = llm.engine.stats
    assert st.spec_decode.num_accepted_tokens > 0
    assert st.spec_decode.num_accepted_tokens < st.spec_decode.num_draft_tokens
    assert st.num_preemptions > 0 and st.prefix_cache_hits > 0
    assert_pool_empty(llm.engine)


def test_ngram_greedy_output_is_identical(make_llm):
    """The real n-gram proposer on repetitive prompts, sync and async."""
    prompts = repetitive_prompts(4, seed=3)
    plain = run(make_llm(max_num_batched_tokens=16), prompts)
    for async_ in (False, True):
        llm = make_llm(max_num_batched_tokens=16, async_scheduling=async_, speculative_config=NGRAM)
        assert run(llm, prompts) == plain
        assert llm.engine.stats.spec_decode.num_draft_tokens > 0


def test_ngram_drafts_are_accepted_on_the_embedded_model(make_llm):
    """The trained embedded model continues code the way its prompt does, so the real n-gram drafts are
    often right: outputs equal plain decoding's, sync and async, with drafts accepted."""
    from hyserve.config import DEFAULT_MODEL, EMBEDDED_MODEL_DIR
    from hyserve.tokenizer import load_tokenizer

    if DEFAULT_MODEL != EMBEDDED_MODEL_DIR:
        pytest.skip("no embedded checkpoint shipped")
    params = SamplingParams(max_tokens=48, temperature=0)
    kw = dict(kv_cache_memory_bytes=256 << 20, max_num_seqs=4)
    base = make_llm(DEFAULT_MODEL, **kw)
    # the checkpoint's own tokenizer (the fixture's engines carry a byte-level one): real code tokens
    tok = load_tokenizer(EMBEDDED_MODEL_DIR, base.engine.model_config.tokenizer_family)
    prompt = tok.encode("def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n")
    prompts = [prompt, prompt[: len(prompt) // 2]]
    plain = run(base, prompts, params)
    for async_ in (False, True):
        llm = make_llm(DEFAULT_MODEL, speculative_config=NGRAM, async_scheduling=async_, **kw)
        assert run(llm, prompts, params) == plain
        st = llm.engine.stats.spec_decode
        assert st.num_accepted_tokens > 0.3 * st.num_draft_tokens


def _states(engine, req_id):
    """(num_computed_tokens, conv, recurrent) of the request's live KDA state after each step."""
    out = []
    while engine.has_unfinished_requests():
        engine.step()
        req = next((r for r in engine.scheduler.running if r.request_id == req_id), None)
        if req is not None:
            t = engine.kv.tensors
            out.append((req.num_computed_tokens, t.conv[req.state_slot].clone(), t.recurrent[req.state_slot].clone()))
    return out


def test_rollback_is_exact(make_engine):
    """After every step the live state (the column of the accepted drafts) equals a plain run's state over
    the same tokens: a rejected draft leaves no trace."""
    prompt = repetitive_prompts(1, 5)[0]
    plain_engine = make_engine(dtype="float32")
    plain_engine.add_request("r", prompt, GREEDY)
    plain = {n: (c, r) for n, c, r in _states(plain_engine, "r")}
    ref = [0]  # the plain run's outputs, for the oracle
    p2 = make_engine(dtype="float32")
    p2.add_request("r", prompt, GREEDY)
    while p2.has_unfinished_requests():
        for o in p2.step():
            ref = o.outputs[0].token_ids
    spec = make_engine(dtype="float32", speculative_config=NGRAM)
    spec.spec.proposer = Oracle({tuple(prompt): ref})
    spec.add_request("r", prompt, GREEDY)
    seen = _states(spec, "r")
    assert spec.stats.spec_decode.num_accepted_tokens < spec.stats.spec_decode.num_draft_tokens
    jumps = [b[0] - a[0] for a, b in zip(seen, seen[1:])]
    assert max(jumps) > 1  # some steps committed accepted drafts
    for n, conv, rec in seen:
        c, r = plain[n]
        torch.testing.assert_close(conv, c, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(rec, r, rtol=1e-5, atol=1e-6)


def test_a_step_without_drafts_after_a_speculative_step_reads_the_current_column(make_llm):
    """Regression 1 (vllm#39273): drafts dry up mid-generation; the plain decodes after the verify steps
    must start from the accepted column, not column 0."""
    prompts = repetitive_prompts(3, 11)
    plain = run(make_llm(), prompts)
    llm = make_llm(speculative_config=NGRAM)
    llm.engine.spec.proposer = Oracle({tuple(p): o for p, o in zip(prompts, plain)}, dry_after=9)
    assert run(llm, prompts) == plain
    assert llm.engine.stats.spec_decode.num_accepted_tokens > 0


@pytest.mark.parametrize("async_", [False, True], ids=["sync", "async"])
def test_checkpoints_never_cover_a_rejected_token(make_llm, async_):
    """Regressions 2 and 3 (vllm#43559, sglang#36537): every draft is wrong; prefix checkpoints taken during
    generation (every 8 tokens, end of generation) hold the state of a plain run at their position, and
    a second request resuming from them equals a cold run."""
    prompt = repetitive_prompts(1, 2)[0][:13]
    kw = dict(prefix_cache_retention_interval=8, async_scheduling=async_)
    plain_llm = make_llm(**kw)
    plain = run(plain_llm, [prompt])
    llm = make_llm(speculative_config=NGRAM, **kw)
    llm.engine.spec.proposer = Oracle({tuple(prompt): plain[0]}, wrong=True)
    assert run(llm, [prompt]) == plain
    assert llm.engine.stats.spec_decode.num_accepted_tokens == 0
    ours, theirs = llm.engine.kv.prefix.checkpoints.ckpts, plain_llm.engine.kv.prefix.checkpoints.ckpts
    assert {k[1] for k in ours} >= {16, 24}
    for key, c in ours.items():
        ref = theirs[key]
        for t in (llm.engine.kv.tensors.recurrent, llm.engine.kv.tensors.conv):
            torch.testing.assert_close(t[c.slot], plain_llm.engine.kv.tensors.recurrent[ref.slot]
                                       if t is llm.engine.kv.tensors.recurrent else plain_llm.engine.kv.tensors.conv[ref.slot])
    turn2 = prompt + plain[0][:14] + [5, 6, 7]
    cold = run(make_llm(enable_prefix_caching=False), [turn2])
    out = llm.generate([turn2], GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens >= 16 and [out.outputs[0].token_ids] == cold


def test_a_one_token_prompt_tail_in_a_verify_step_is_a_prefill(make_engine):
    """Regression 4 (vllm#55178): the kind is explicit. A prompt's last chunk of one token scheduled beside a
    verify row is a prefill, is not one of the step's verify rows, samples from its one row, and leaves the
    state a whole-prompt prefill leaves."""
    eng = make_engine(dtype="float32", speculative_config=NGRAM)
    eng.add_request("a", [1, 2, 3, 1, 2, 3, 1, 2], GREEDY)
    eng.add_request("b", [9, 8, 7, 6, 5], GREEDY)
    a, b = list(eng.scheduler.waiting)
    eng.scheduler.waiting.clear()
    for r, n in ((a, 8), (b, 4)):  # a: its prompt computed, one output; b: 4 of its 5 prompt tokens
        eng.kv.allocate_slots(r, n, eng.kv.get_computed_tokens(r))
        eng.kv.begin_step(SchedulerOutput([ScheduledSeq(r, n, 0)]))
        eng.runner.execute(SchedulerOutput([ScheduledSeq(r, n, 0)]))
        eng.scheduler.running.append(r)
    a.output_token_ids = [3]
    seqs = [ScheduledSeq(a, 1 + K, 8, False, [1, 2, 3]), ScheduledSeq(b, 1, 4, False)]
    eng.kv.allocate_slots(a, 1 + K)
    eng.kv.allocate_slots(b, 1)
    assert [s.kind for s in seqs] == ["verify", "prefill"]
    assert ScheduledSeq(a, 1, 9, False).kind == "decode"
    inputs = build_step_inputs(seqs, eng.kv.block_size)
    assert inputs.verify.seqs == [0] and inputs.verify.src == [0] and inputs.verify.logit_counts == [1 + K, 1]
    assert inputs.layout.views(inputs.flat).logits_indices.tolist() == [0, 1, 2, 3, 4]
    eng.kv.begin_step(SchedulerOutput(seqs))
    logits = eng.runner.execute(SchedulerOutput(seqs))
    assert logits.sample_rows == [0, 1] and logits.logits.shape[0] == 1 + K + 1
    ref = make_engine(dtype="float32")
    ref.add_request("b", [9, 8, 7, 6, 5], SamplingParams(max_tokens=1))
    rb = ref.scheduler.waiting[0]
    ref.kv.allocate_slots(rb, 5, ref.kv.get_computed_tokens(rb))
    ref.kv.begin_step(SchedulerOutput([ScheduledSeq(rb, 5, 0)]))
    want = ref.runner.execute(SchedulerOutput([ScheduledSeq(rb, 5, 0)])).logits[0]
    torch.testing.assert_close(logits.logits[-1], want, rtol=1e-4, atol=1e-4)
    for t in ("conv", "recurrent"):
        torch.testing.assert_close(getattr(eng.kv.tensors, t)[b.state_slot], getattr(ref.kv.tensors, t)[rb.state_slot],
                                   rtol=1e-4, atol=1e-5)
    for e, reqs in ((eng, (a, b)), (ref, (rb,))):
        for r in reqs:
            e.scheduler.finish(r, RequestStatus.FINISHED_ABORTED)
        e.parents.clear()


def test_verify_rows_fit_the_budget_max_tokens_and_max_model_len(make_llm):
    from hyserve.engine.request import Request
    from hyserve.spec_decode.scheduling import verify_len

    req = Request("r", [1] * 10, GREEDY, max_tokens=8, output_token_ids=[2] * 3, spec_token_ids=[3] * K)
    assert verify_len(req, 100, 100) == 1 + K
    assert verify_len(req, 2, 100) == 2  # the step's token budget counts every verified position
    assert verify_len(req, 100, 15) == 2  # 13 tokens: the bonus token must fit max_model_len 15 too
    req.output_token_ids = [2] * 6
    assert verify_len(req, 100, 100) == 2  # one output left after the draft: the correction or bonus
    req.output_token_ids = [2] * 7
    assert verify_len(req, 100, 100) == 1
    prompts = repetitive_prompts(2, 8)
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    limit = max(map(len, prompts)) + 11
    plain = run(make_llm(max_model_len=limit), prompts, params)
    llm = make_llm(max_model_len=limit, speculative_config=NGRAM)
    llm.engine.spec.proposer = Oracle({tuple(p): o + [0] * K for p, o in zip(prompts, plain)})
    assert run(llm, prompts, params) == plain
    assert [len(p) + len(o) for p, o in zip(prompts, plain)] == [limit] * 2
    assert llm.engine.stats.spec_decode.num_accepted_tokens > 0


def test_a_stop_among_accepted_drafts_ends_the_request_there(make_llm):
    """Stop checks run token by token: a stop token inside the accepted drafts finishes the request at it (the
    rest dropped), and what the prefix cache kept at that finish resumes as a cold run would."""
    prompts = repetitive_prompts(3, 12)
    refs = {tuple(p): o for p, o in zip(prompts, run(make_llm(), prompts))}
    stops = [o[6] for o in refs.values()]
    params = SamplingParams(max_tokens=24, temperature=0, stop_token_ids=stops, include_stop_str_in_output=True)
    want = [(o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].stop_reason)
            for o in make_llm().generate(prompts, params, use_tqdm=False)]
    llm = make_llm(speculative_config=NGRAM)
    llm.engine.spec.proposer = Oracle(refs)
    llm.engine.spec.proposer.calls = K - 1  # the first verify steps accept every draft
    got = [(o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].stop_reason)
           for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want and all(len(t) < 24 for t, _, _ in got)
    turn2 = [p + t + [4, 5] for p, (t, _, _) in zip(prompts, got)]
    cold = run(make_llm(enable_prefix_caching=False), turn2)
    outs = llm.generate(turn2, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == cold and all(o.num_cached_tokens > 0 for o in outs)


def test_preemption_and_abort_mid_speculation_free_every_slot(make_engine):
    eng = make_engine(speculative_config=NGRAM, num_gpu_blocks=12, block_size=4)
    for i, p in enumerate(repetitive_prompts(4, 9)):
        eng.add_request(str(i), p[:16], GREEDY)
    slots = eng.kv.pool_stats["state_slots_capacity"]
    assert slots == eng.cfg.max_num_seqs * (1 + K)
    for _ in range(12):
        eng.step()
    assert any(r.spec_slots for r in eng.scheduler.running)
    assert all(len(r.spec_slots) == 1 + K for r in eng.scheduler.running)
    for i in range(4):
        eng.abort_request(str(i))
    assert eng.scheduler.num_preemptions > 0
    stats = eng.kv.pool_stats
    assert stats["state_slots_free"] == stats["state_slots_capacity"]
    assert_pool_empty(eng)


def test_synthetic_acceptance_through_the_engine(make_llm):
    """rejection_sample_method 'synthetic' fixes the acceptance curve (benchmarks): length 3 with 3 drafts
    accepts exactly 2 per verify step whatever the drafts are."""
    spec = dict(NGRAM, rejection_sample_method="synthetic", synthetic_acceptance_length=3.0)
    llm = make_llm(speculative_config=spec)
    llm.engine.spec.proposer = Oracle({(1, 2, 3): [0] * 64}, wrong=True)
    out = run(llm, [[1, 2, 3]], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    st = llm.engine.stats.spec_decode
    assert len(out[0]) == 20 and st.num_drafts > 0
    assert st.num_accepted_tokens == 2 * st.num_drafts
    assert st.accepted_per_position[:3] == [st.num_drafts, st.num_drafts, 0]


def test_synthetic_acceptance_verifies_k_drafts_where_the_proposer_finds_none(make_llm):
    """A prompt n-gram lookup cannot match still runs the curve's step shapes: k drafts every step."""
    spec = dict(NGRAM, rejection_sample_method="synthetic", synthetic_acceptance_length=2.0)
    llm = make_llm(speculative_config=spec)
    out = run(llm, [[11, 29, 7, 101, 54]], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    st = llm.engine.stats.spec_decode
    assert len(out[0]) == 16 and st.num_drafts > 0
    assert st.num_draft_tokens > K * (st.num_drafts - 1)  # the last step's cut to max_tokens
    assert st.num_accepted_tokens == st.num_drafts  # length 2.0: one accepted per step


def test_spec_metrics_and_stats_line(make_llm):
    from hyserve.engine.engine_core import _EngineLoop
    from hyserve.metrics import ServerMetrics
    from hyserve.stats_logger import LoggingStatLogger

    prompts = repetitive_prompts(2, 4)
    plain = run(make_llm(), prompts)
    llm = make_llm(speculative_config=NGRAM)
    llm.engine.spec.proposer = Oracle({tuple(p): o for p, o in zip(prompts, plain)})
    logger = LoggingStatLogger(emit=lambda line: None)
    logger.log()
    run(llm, prompts)
    stats = _EngineLoop._stats(type("L", (), {"engine": llm.engine})())
    st = stats["spec_decode"]
    logger.record(stats)
    line = logger.log()
    mean = 1 + st["num_accepted_tokens"] / st["num_drafts"]
    assert f"Mean acceptance length: {mean:.2f}" in line and "Per-position acceptance rate: [" in line
    text = ServerMetrics("m", lambda: stats).render().decode()
    assert f'vllm:spec_decode_num_drafts_total{{engine="0",model_name="m"}} {float(st["num_drafts"])}' in text
    assert f"vllm:spec_decode_num_accepted_tokens_total{{engine=\"0\",model_name=\"m\"}} {float(st['num_accepted_tokens'])}" in text
    assert "vllm:spec_decode_num_draft_tokens_total" in text
    assert f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="m",position="0"}} ' \
           f'{float(st["accepted_per_position"][0])}' in text
    plain_text = ServerMetrics("m", lambda: _EngineLoop._stats(type("L", (), {"engine": make_llm().engine})())).render()
    assert b"spec_decode" not in plain_text


def _drafted_steps_under(llm, prompts, params) -> tuple[list[list[int]], list[tuple[int, bool]]]:
    """(outputs, (running requests, whether the step verified drafts) of every step)."""
    scheduler, steps = llm.engine.scheduler, []
    schedule = scheduler.schedule

    def spy():
        out = schedule()
        steps.append((len(scheduler.running), any(s.draft_ids for s in out.seqs)))
        return out

    scheduler.schedule = spy
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)], steps


DISABLE_PARAMS = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (8, 24)]


def test_speculation_turns_itself_off_at_disable_by_batch_size(make_llm):
    """vLLM's disable_by_batch_size: while the running batch holds that many requests nothing drafts; once
    the batch is smaller again, speculation resumes. The output stays plain decoding's."""
    prompts = repetitive_prompts(2, 6)
    plain = [o.outputs[0].token_ids for o in make_llm().generate(prompts, DISABLE_PARAMS, use_tqdm=False)]
    llm = make_llm(speculative_config=dict(NGRAM, disable_by_batch_size=2))
    llm.engine.spec.proposer = Oracle({tuple(p): o for p, o in zip(prompts, plain)})
    out, steps = _drafted_steps_under(llm, prompts, DISABLE_PARAMS)
    assert out == plain
    assert not any(drafted for running, drafted in steps if running >= 2), steps
    assert any(drafted for running, drafted in steps if running == 1), "speculation resumes below the limit"


def test_steps_overlap_again_while_speculation_is_off_under_load(make_llm):
    """Async scheduling: at disable_by_batch_size nothing drafts, so nothing needs the host tokens of the step
    before: the next step launches before it is read back, as without speculation, and the output is the
    same."""
    prompts = repetitive_prompts(3, seed=4)
    plain = run(make_llm(async_scheduling=True), prompts)
    llm = make_llm(async_scheduling=True, speculative_config=dict(NGRAM, disable_by_batch_size=3))
    overlapped = launches_overlapped(llm.engine)
    assert run(llm, prompts) == plain
    assert any(overlapped)


def launches_overlapped(engine) -> list[bool]:
    """A list that gets, for every step the engine launches, whether the step before was still in flight
    (not read back yet)."""
    overlapped, launch = [], engine._launch

    def counted(out, prev):
        overlapped.append(prev is not None)
        return launch(out, prev)

    engine._launch = counted
    return overlapped


class Exact:
    """A drafter that knows the plain run's outputs and is always right."""

    def __init__(self, refs: dict[tuple[int, ...], list[int]]):
        self.refs = refs

    def __len__(self) -> int:
        return 0

    def propose(self, histories, keys=None):
        out = []
        for h in histories:
            h = h[:]
            prompt = next(p for p in self.refs if tuple(h[: len(p)]) == p and len(h) >= len(p))
            out.append(list(self.refs[prompt][len(h) - len(prompt) :][:K]))
        return out


BUDGETED = {k: v for k, v in NGRAM.items() if k != "confidence_threshold"}  # the default: a draft budget
LONG = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)


def test_the_draft_budget_stops_verifying_drafts_that_never_pass_and_keeps_the_output(make_llm):
    prompts = repetitive_prompts(3, seed=5)
    plain = run(make_llm(async_scheduling=True), prompts, LONG)
    refs = {tuple(p): o for p, o in zip(prompts, plain)}
    every = make_llm(async_scheduling=True, speculative_config=NGRAM)
    every.engine.spec.proposer = Oracle(refs, wrong=True)
    budgeted = make_llm(async_scheduling=True, speculative_config=BUDGETED)
    budgeted.engine.spec.proposer = Oracle(refs, wrong=True)
    assert run(every, prompts, LONG) == plain and run(budgeted, prompts, LONG) == plain
    assert every.engine.stats.spec_decode.num_drafts > 100  # every step of every request
    # three misses each until their rates fall, then a retry every few dozen steps
    assert budgeted.engine.stats.spec_decode.num_drafts <= 20


def test_the_draft_budget_verifies_every_draft_of_a_drafter_that_is_always_right(make_llm):
    prompts = repetitive_prompts(3, seed=5)
    plain = run(make_llm(), prompts, LONG)
    llm = make_llm(speculative_config=BUDGETED)
    llm.engine.spec.proposer = Exact({tuple(p): o for p, o in zip(prompts, plain)})
    assert run(llm, prompts, LONG) == plain
    st = llm.engine.stats.spec_decode
    assert st.num_accepted_tokens == st.num_draft_tokens > 0
    assert st.num_draft_tokens >= K * (st.num_drafts - len(prompts))  # full drafts but at each request's end


def test_steps_overlap_while_the_draft_budget_lets_no_request_draft(make_llm):
    """Async scheduling: while no request's drafts could pay (new requests' drafts are judged in the shadow
    first, and these never pass), the engine does not wait for a step's tokens to draft: steps launch while
    the step before is in flight, and the output is the same."""
    prompts = repetitive_prompts(2, seed=6)
    plain = run(make_llm(async_scheduling=True), prompts, LONG)
    llm = make_llm(async_scheduling=True, speculative_config=BUDGETED)
    llm.engine.spec.proposer = Oracle({tuple(p): o for p, o in zip(prompts, plain)}, wrong=True)
    overlapped = launches_overlapped(llm.engine)
    assert run(llm, prompts, LONG) == plain
    assert sum(overlapped) >= 0.9 * len(overlapped) and sum(overlapped[-20:]) >= 15


def test_dspark_turns_itself_off_at_disable_by_batch_size(make_llm, drafter_dir):
    prompts = repetitive_prompts(2, 8)
    plain = [o.outputs[0].token_ids for o in make_llm(enable_prefix_caching=False).generate(
        prompts, DISABLE_PARAMS, use_tqdm=False)]
    spec = {"method": "dspark", "model": drafter_dir, "disable_by_batch_size": 2}
    out, steps = _drafted_steps_under(make_llm(enable_prefix_caching=False, speculative_config=spec), prompts,
                                      DISABLE_PARAMS)
    assert out == plain
    assert not any(drafted for running, drafted in steps if running >= 2), steps
    assert any(drafted for running, drafted in steps if running == 1)


@pytest.mark.parametrize("value, message", [
    ('{"method": "dspark", "model": "/x"}', "no config.json there"),
    ('{"method": "ngram"}', "needs num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": 4, "draft_sample_method": "probabilistic"}', "one-hot"),
    ("{not json", "not valid JSON"),
    ('{"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": 1}', "disable_by_batch_size"),
    ('{"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": true}', "disable_by_batch_size"),
])
def test_bad_speculative_configs_are_refused(value, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(speculative_config=value)
    with pytest.raises(ValueError, match="exceeds max_num_batched_tokens"):
        EngineConfig(speculative_config=NGRAM, max_num_batched_tokens=3)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(speculative_config=NGRAM, tensor_parallel_size=2)


def test_the_cli_flag_parses_and_refuses(tmp_path):
    from hyserve.entrypoints.cli import build_parser
    from hyserve.entrypoints.engine_args import engine_kwargs_from_args

    for cmd in (["serve"], ["generate", "--prompt", "x"]):
        args = build_parser().parse_args(cmd + ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'])
        cfg = EngineConfig(**engine_kwargs_from_args(args))
        assert cfg.speculative_config.num_speculative_tokens == 2
    bad = subprocess.run([sys.executable, "-m", "hyserve.entrypoints.cli", "generate", "--prompt", "x",
                          "--speculative-config", '{"method": "eagle"}'], capture_output=True, text=True, cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}, timeout=120)
    assert bad.returncode != 0 and "speculative method must be one of" in bad.stderr


def test_sampled_speculation_is_seeded_and_respects_top_k_top_p(make_llm):
    """Temperature > 0 through the verify path: a seeded request repeats itself, and every emitted token
    (accepted draft, recovered or bonus) lies in the row's top-k and top-p set (checked against the
    target's logits at its position, recomputed by a plain forward)."""
    prompts = repetitive_prompts(2, 6)
    refs = {tuple(p): o for p, o in zip(prompts, run(make_llm(), prompts))}  # greedy drafts: often accepted
    params = SamplingParams(max_tokens=16, temperature=1.0, top_k=5, top_p=0.9, seed=7, ignore_eos=True, logprobs=20)
    outs = []
    for _ in range(2):
        llm = make_llm(speculative_config=NGRAM)
        llm.engine.spec.proposer = Oracle(refs)
        got = llm.generate(prompts, params, use_tqdm=False)
        outs.append([o.outputs[0].token_ids for o in got])
        st = llm.engine.stats.spec_decode
        assert 0 < st.num_accepted_tokens < st.num_draft_tokens
    assert outs[0] == outs[1]
    for o in got:  # the raw logprobs of each position's 20 best tokens: the top-k/top-p set is in them
        for tok, lps in zip(o.outputs[0].token_ids, o.outputs[0].logprobs):
            ranked = sorted(((lp.logprob, t) for t, lp in lps.items() if lp.rank is not None and lp.rank <= 20), reverse=True)
            top = [t for _, t in ranked[:5]]
            probs = torch.tensor([lp for lp, _ in ranked[:5]]).softmax(0)
            keep = int((probs.cumsum(0) - probs < 0.9).sum())
            assert tok in top[:keep]


def test_generate_with_the_flag_matches_plain_decoding_on_the_embedded_model(capsys):
    """`hyserve generate --speculative-config` end to end, on the trained embedded model, whose code-like
    continuations the n-gram drafts partly predict."""
    import argparse
    import json

    from hyserve.entrypoints.generate import add_generate_parser, run_generate

    prompt = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n"
    rows = []
    for extra in ([], ["--speculative-config", json.dumps(NGRAM)]):
        parser = argparse.ArgumentParser()
        add_generate_parser(parser.add_subparsers())
        args = parser.parse_args(["generate", "--prompt", prompt, "--device", "cpu", "--block-size", "16",
                                  "--max-tokens", "32", "--temperature", "0", "--output", "jsonl", *extra])
        assert run_generate(args) == 0
        rows.append(json.loads(capsys.readouterr().out.splitlines()[0]))
    assert rows[0]["token_ids"] == rows[1]["token_ids"] and len(rows[0]["token_ids"]) > 0


def test_serve_with_the_flag_shows_the_counters_on_metrics():
    """`hyserve serve --speculative-config` end to end: completions go through verify steps and /metrics
    carries vLLM's spec_decode counters."""
    import json

    import httpx

    from tests.server_util import live_server, metric

    flags = ("--speculative-config", json.dumps(NGRAM), "--device", "cpu", "--block-size", "16",
             "--kv-cache-memory-bytes", str(128 << 20), "--max-num-seqs", "4")
    with live_server(*flags) as url:
        r = httpx.post(f"{url}/v1/completions", json={"model": "k3-tiny", "prompt": "abcabcabcabcabc", "max_tokens": 16,
                                                       "temperature": 0, "ignore_eos": True}, timeout=120)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 16
        drafts = metric(url, "vllm:spec_decode_num_draft_tokens_total")
        assert drafts > 0 and metric(url, "vllm:spec_decode_num_drafts_total") > 0
        accepted = metric(url, "vllm:spec_decode_num_accepted_tokens_total")
        assert metric(url, "vllm:spec_decode_num_accepted_tokens_per_pos_total") == accepted


def test_dspark_greedy_output_is_identical_and_drafts_match_the_reference(make_llm, tiny_model, drafter_dir):
    """method 'dspark' through the engine (the reference path): chunked prefill, preemption and async
    scheduling leave greedy outputs unchanged, and every block it drafts equals the reference proposer's
    over the whole history (the drafter's context holds exactly the computed, accepted positions). Every
    draft verified (no draft budget): a request that verified drafts drafts again at once."""
    from hyserve.spec_decode.dspark_io import load_drafter
    from hyserve.spec_decode.dspark_propose import DSparkProposer
    from hyserve.spec_decode.reference_loop import dspark_propose

    kw = dict(enable_prefix_caching=False, max_num_batched_tokens=12, block_size=4, num_gpu_blocks=20,
              async_scheduling=True)
    prompts = repetitive_prompts(4, 21)
    plain = run(make_llm(**kw), prompts)
    llm = make_llm(speculative_config={"method": "dspark", "model": drafter_dir, "confidence_threshold": 0}, **kw)
    proposer, seen = llm.engine.spec.proposer, []
    original = proposer.propose

    def history(n: int, anchor: int) -> tuple[list[int], list[int]]:
        """(the history whose last token is `anchor` at position n, the plain run's tokens after it)."""
        return next((h, o[i:]) for p, o in zip(prompts, plain) for i in range(1, len(o) + 1)
                    if len(h := p + o[:i]) == n + 1 and h[-1] == anchor)

    def recording(req_ids, anchors, temps=None, gens=None):
        """The drafter's blocks are recorded; every other one is replaced by the right continuation, so
        verify steps accept drafts and the context must grow by the accepted positions."""
        block = original(req_ids, anchors, temps, gens)
        for i, (r, a) in enumerate(zip(req_ids, anchors.tolist())):
            n = llm.engine.spec.proposer.num_context(r)
            seen.append((n, a, block.token_ids[i].tolist()))
            right = history(n, a)[1][:K + 1]
            if len(seen) % 2 and len(right) == K + 1:
                block.token_ids[i] = torch.tensor(right)
        return block

    proposer.propose = recording
    landed, redrafted = llm.engine.spec.land, []

    def land(seqs, res, now, engine):  # a request that verified drafts again in the same landing
        landed(seqs, res, now, engine)
        redrafted.extend(bool(s.req.spec_token_ids) for s in seqs if s.draft_ids and not s.req.is_finished)

    llm.engine.spec.land = land
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == plain
    assert redrafted and all(redrafted)
    st = llm.engine.stats.spec_decode
    assert 0 < st.num_accepted_tokens < st.num_draft_tokens and llm.engine.stats.num_preemptions > 0
    assert llm.engine.spec.proposer.rows == {}  # every request's rows were dropped when it finished
    target, _ = tiny_model("k3-tiny")
    ref = dspark_propose(target, DSparkProposer(load_drafter(drafter_dir, target)))
    for n, anchor, drafts in seen[::3]:
        torch.testing.assert_close(ref(history(n, anchor)[0], GREEDY, None)[0], drafts, rtol=0, atol=0)


def test_dspark_refusals(tiny_model, drafter_dir):
    with pytest.raises(ValueError, match="exceeds the drafter's block size"):
        EngineConfig(enable_prefix_caching=False, speculative_config={"method": "dspark", "model": drafter_dir,
                                                                      "num_speculative_tokens": 5})
    cfg = EngineConfig(enable_prefix_caching=False, speculative_config={"method": "dspark", "model": drafter_dir})
    assert cfg.speculative_config.num_speculative_tokens == 4  # the drafter's block size


def test_dspark_probabilistic_drafts_are_seeded_and_respect_top_k(make_llm, drafter_dir):
    """draft_sample_method 'probabilistic': drafts drawn at the request's temperature with their
    distributions handed to rejection sampling; a seeded request repeats itself and stays in its top-k."""
    spec = {"method": "dspark", "model": drafter_dir, "draft_sample_method": "probabilistic"}
    params = SamplingParams(max_tokens=16, temperature=1.0, top_k=3, seed=3, ignore_eos=True, logprobs=3)
    prompts = repetitive_prompts(2, 5)
    outs = []
    for _ in range(2):
        llm = make_llm(enable_prefix_caching=False, speculative_config=spec)
        got = llm.generate(prompts, params, use_tqdm=False)
        outs.append([o.outputs[0].token_ids for o in got])
        assert llm.engine.stats.spec_decode.num_draft_tokens > 0
    assert outs[0] == outs[1]
    for o in got:
        for tok, lps in zip(o.outputs[0].token_ids, o.outputs[0].logprobs):
            assert lps[tok].rank <= 3


def test_dspark_confidence_threshold_verifies_the_drafts_whose_survival_clears_it(make_llm, drafter_dir):
    """confidence_threshold: each request verifies the leading drafts whose predicted survival (the running
    product of the confidence head's outputs) is at least the threshold, and greedy output is unchanged."""
    from hyserve.spec_decode.confidence import threshold_lengths

    prompts = repetitive_prompts(3, 9)
    plain = run(make_llm(enable_prefix_caching=False), prompts)
    spec = {"method": "dspark", "model": drafter_dir, "confidence_threshold": 0.25}
    llm = make_llm(enable_prefix_caching=False, speculative_config=spec)
    decoder, expected, got = llm.engine.spec, {}, []
    original_block, original_propose = decoder.proposer.propose, decoder.propose

    def block_of(req_ids, anchors, temps=None, gens=None):
        block = original_block(req_ids, anchors, temps, gens)
        expected.update(zip(req_ids, threshold_lengths(block.confidence, 0.25).tolist()))
        return block

    def propose(reqs):
        expected.clear()
        original_propose(reqs)
        got.extend((len(r.spec_token_ids), expected[r.request_id]) for r in reqs if r.request_id in expected)

    decoder.proposer.propose, decoder.propose = block_of, propose
    assert run(llm, prompts) == plain
    assert got and all(n == want for n, want in got)
    assert {n for n, _ in got} - {0, decoder.proposer.k}  # the threshold cut some blocks part-way


def test_dspark_confidence_threshold_of_one_verifies_nothing(make_llm, drafter_dir):
    prompts = repetitive_prompts(2, 4)
    spec = {"method": "dspark", "model": drafter_dir, "confidence_threshold": 1.0}
    llm = make_llm(enable_prefix_caching=False, speculative_config=spec)
    assert run(llm, prompts) == run(make_llm(enable_prefix_caching=False), prompts)
    assert llm.engine.stats.spec_decode.num_draft_tokens == 0


def test_dspark_with_prefix_caching_drafts_after_a_hit_and_keeps_the_output(make_llm, drafter_dir):
    """A prefix hit skips the target features of its cached tokens: the request drafts from the context
    computed after the hit, and greedy output stays that of plain decoding (prefix caching on both)."""
    prompts = repetitive_prompts(3, 21)
    prompts = prompts + [p + [7, 8, 9] for p in prompts]  # the second three extend the first: hits
    spec = {"method": "dspark", "model": drafter_dir}
    plain_llm, llm = make_llm(), make_llm(speculative_config=spec)
    plain = [run(plain_llm, prompts[:3]), run(plain_llm, prompts[3:])]  # in turn, so the second three hit
    decoder, first_rows = llm.engine.spec, []
    original = decoder.proposer.extend

    def extend(rid, features, start):
        if rid not in decoder.proposer.rows and features.shape[0]:
            first_rows.append(start)
        original(rid, features, start)

    decoder.proposer.extend = extend
    assert [run(llm, prompts[:3]), run(llm, prompts[3:])] == plain
    assert llm.engine.stats.prefix_cache_hits > 0 and max(first_rows) > 0  # a context started past 0
    st = llm.engine.stats.spec_decode
    assert st.num_draft_tokens > 0 and decoder.proposer.rows == {} and decoder.proposer.first == {}


def test_a_drafter_context_that_starts_past_zero_keeps_its_positions(tiny_model, drafter_dir):
    from hyserve.spec_decode.dspark_io import load_drafter
    from hyserve.spec_decode.dspark_propose import DSparkProposer

    target, _ = tiny_model("k3-tiny")
    proposer = DSparkProposer(load_drafter(drafter_dir, target))
    width = proposer.drafter.fc.in_features
    proposer.add_context("r", torch.randn(3, width), torch.arange(5, 8))
    assert proposer.num_context("r") == 8
    with pytest.raises(ValueError, match="in order"):
        proposer.add_context("r", torch.randn(1, width), torch.tensor([9]))
    proposer.truncate("r", 6)
    assert proposer.num_context("r") == 6 and proposer.rows["r"][0].shape[0] == 1
    proposer.truncate("r", 4)  # before its first row: nothing is left
    assert proposer.num_context("r") == 0 and "r" not in proposer.first


class Turning(Oracle):
    """Wrong drafts until a request has `right_after` outputs, then the plain run's (always right)."""

    def __init__(self, refs: dict[tuple[int, ...], list[int]], right_after: int):
        super().__init__(refs, wrong=True)
        self.exact, self.right_after, self.first_accepted = Exact(refs), right_after, {}

    def propose(self, histories, keys=None):
        wrong, right = super().propose(histories), self.exact.propose(histories)
        return [r if len(h) - len(next(p for p in self.refs if tuple(h[: len(p)]) == p)) >= self.right_after else w
                for h, w, r in zip(histories, wrong, right)]


def test_a_turned_down_request_whose_drafts_keep_missing_is_not_tried_again(make_llm):
    """Its turned-down drafts are still scored against the tokens emitted (shadow trials), so its rate stays
    down: no verify step carries its drafts past its first few tokens (an idle decay alone retried every few
    dozen steps)."""
    prompts = repetitive_prompts(3, seed=5)
    plain = run(make_llm(async_scheduling=True), prompts, LONG)
    llm = make_llm(async_scheduling=True, speculative_config=BUDGETED)
    llm.engine.spec.proposer = Oracle({tuple(p): o for p, o in zip(prompts, plain)}, wrong=True)
    verified_at = []
    land = llm.engine.spec.land

    def spied(seqs, res, now, engine):
        verified_at.extend(len(s.req.output_token_ids) for s in seqs if s.draft_ids)
        return land(seqs, res, now, engine)

    llm.engine.spec.land = spied
    assert run(llm, prompts, LONG) == plain
    assert max(verified_at, default=0) < 10, verified_at


def test_a_turned_down_request_drafts_again_as_soon_as_its_drafts_would_pass(make_llm):
    prompts = repetitive_prompts(3, seed=5)
    plain = run(make_llm(), prompts, LONG)
    refs = {tuple(p): o for p, o in zip(prompts, plain)}
    llm = make_llm(speculative_config=BUDGETED)
    llm.engine.spec.proposer = Turning(refs, right_after=20)
    accepted_at = []
    land = llm.engine.spec.land

    def spied(seqs, res, now, engine):
        accepted_at.extend(len(s.req.output_token_ids) for s, a in zip(seqs, res.num_accepted.tolist()) if a)
        return land(seqs, res, now, engine)

    llm.engine.spec.land = spied
    assert run(llm, prompts, LONG) == plain
    assert accepted_at and min(accepted_at) <= 30, accepted_at
    assert llm.engine.stats.spec_decode.num_accepted_tokens >= 40
