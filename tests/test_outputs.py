"""The engine's outputs: per-step deltas (`step_deltas`) that add up to the whole output, stop-string
holdback while streaming, and `step()` shaping them by output_kind as vLLM does (CUMULATIVE, DELTA,
FINAL_ONLY); plus the `last_step` record of what the read-back step computed."""

from __future__ import annotations

import pytest

from hyserve import SamplingParams
from hyserve.sampling_params import RequestOutputKind

LETTERS = {ord(c): 30.0 for c in "abcdefghijklmnopqrstuvwxyz"}  # force plain ASCII text
EOS = 258  # the byte tokenizer's [EOS]; the tiny presets' eos_token_id
PROMPT = list(b"once upon a time")


def deltas_of(engine, rid: str, prompt: list[int], params: SamplingParams) -> list:
    engine.add_request(rid, prompt, params)
    got = []
    while engine.has_unfinished_requests():
        got += [d for d in engine.step_deltas() if d.request_id == rid]
    return got


def joined(deltas, index: int = 0) -> tuple[list[int], str, list]:
    comps = [c for d in deltas for c in d.completions if c.index == index]
    return [t for c in comps for t in c.token_ids], "".join(c.text for c in comps), [x for c in comps for x in c.logprobs or ()]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_deltas_add_up_to_the_final_output(make_llm, async_scheduling):
    llm = make_llm(async_scheduling=async_scheduling)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2, logit_bias=LETTERS)
    whole = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    deltas = deltas_of(llm.engine, "d", PROMPT, params)
    ids, text, lps = joined(deltas)
    assert (ids, text, lps) == (whole.token_ids, whole.text, whole.logprobs)
    assert deltas[-1].finished and deltas[-1].completions[-1].finish_reason == "length"
    assert deltas[-1].completions[-1].cumulative_logprob == pytest.approx(whole.cumulative_logprob)
    assert all(len(c.token_ids) <= 1 for d in deltas for c in d.completions)  # news, never repeats


@pytest.mark.parametrize("include", [False, True])
def test_streamed_text_never_shows_what_a_stop_string_cuts(make_llm, include):
    llm = make_llm()
    free = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True,
                                                 logit_bias=LETTERS), use_tqdm=False)[0].outputs[0].text
    stop = free[6:10]  # four characters: three of them may be held back at a time
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logit_bias=LETTERS, stop=[stop],
                            include_stop_str_in_output=include)
    deltas = deltas_of(llm.engine, "s", PROMPT, params)
    final = free[: free.index(stop) + (len(stop) if include else 0)]
    sent = ""
    for d in deltas:
        for c in d.completions:
            sent += c.text
            assert final.startswith(sent)  # nothing sent was cut later
    assert sent == final and deltas[-1].completions[-1].stop_reason == stop


def test_each_completion_reports_its_finish_once(make_engine):
    engine = make_engine()
    params = SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=30, logit_bias={EOS: 3.0})
    deltas = deltas_of(engine, "n", [1, 2, 3], params)
    finishes = [c.index for d in deltas for c in d.completions if c.finish_reason is not None]
    assert sorted(finishes) == [0, 1, 2]
    assert [d.finished for d in deltas].count(True) == 1 and deltas[-1].finished


def test_chunked_prompt_logprobs_arrive_once_and_whole(make_engine):
    engine = make_engine(max_num_batched_tokens=7)
    prompt = list(range(1, 21))
    deltas = deltas_of(engine, "p", prompt, SamplingParams(max_tokens=3, prompt_logprobs=1, ignore_eos=True))
    sent = [d.prompt_logprobs for d in deltas if d.prompt_logprobs is not None]
    assert len(sent) == 1 and len(sent[0]) == len(prompt) and sent[0][0] is None


def _outputs(engine, kind: RequestOutputKind) -> list:
    engine.add_request("k", PROMPT, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, output_kind=kind))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    return outs


def test_cumulative_outputs_are_growing_snapshots(make_engine):
    outs = _outputs(make_engine(), RequestOutputKind.CUMULATIVE)
    ids = [o.outputs[0].token_ids for o in outs]
    assert [len(i) for i in ids] == list(range(1, 7))  # taken when handed out, not changed afterwards
    assert all(b[: len(a)] == a for a, b in zip(ids, ids[1:])) and outs[-1].finished


def test_delta_outputs_hand_out_each_steps_news(make_engine):
    whole = _outputs(make_engine(), RequestOutputKind.FINAL_ONLY)
    outs = _outputs(make_engine(), RequestOutputKind.DELTA)
    assert len(whole) == 1 and len(outs) == 6 and [len(o.outputs[0].token_ids) for o in outs] == [1] * 6
    assert [t for o in outs for t in o.outputs[0].token_ids] == whole[0].outputs[0].token_ids
    assert "".join(o.outputs[0].text for o in outs) == whole[0].outputs[0].text
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "length"


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_last_step_records_what_the_read_back_step_computed(make_engine, async_scheduling):
    engine = make_engine(async_scheduling=async_scheduling, enable_prefix_caching=False)
    for rid in "ab":
        engine.add_request(rid, list(range(1, 11)), SamplingParams(max_tokens=3, ignore_eos=True))
    records = []
    while engine.has_unfinished_requests():
        engine.step_deltas()
        records.append(engine.last_step)
    if async_scheduling:
        assert records[0] is None  # the first call only launched the prefill
        records = records[1:]
    first, *rest = records
    assert (first.num_seqs, first.num_prompt_tokens, first.num_decode_tokens) == (2, 20, 0)
    assert [(r.num_seqs, r.num_prompt_tokens, r.num_decode_tokens) for r in rest[:2]] == [(2, 0, 2)] * 2
