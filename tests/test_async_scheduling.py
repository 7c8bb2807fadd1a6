"""Async scheduling (EngineConfig.async_scheduling, `--async-scheduling`): step k+1 is launched before
step k's tokens are read back, and reads them on the device. It must never change what a request
outputs, nor leak a page or a slot (make_engine checks the pool after every test)."""

from __future__ import annotations

import random

import pytest
from conftest import assert_pool_empty

from hyserve import SamplingParams
from hyserve.structured.constraint import StructuredSpec, compile_spec

EOS = 258  # the byte tokenizer's [EOS]; the tiny presets' eos_token_id


def prompts(n: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def completions(outputs) -> list[tuple[list[int], str, str | None]]:
    return [(c.token_ids, c.text, c.finish_reason) for o in outputs for c in o.outputs]


def both(make_llm, ps, params, **kwargs):
    """(synchronous outputs, async outputs) of the same requests on two engines built alike."""
    sync = make_llm(**kwargs).generate(ps, params, use_tqdm=False)
    llm = make_llm(async_scheduling=True, **kwargs)
    return completions(sync), completions(llm.generate(ps, params, use_tqdm=False))


@pytest.mark.parametrize(
    "model, prefix_caching, graphs",
    [("k3-tiny", True, False), ("k3-tiny", False, True), ("kimi-linear-tiny", True, True), ("k3.1-tiny", True, False)],
    ids=["k3", "k3-graph-buffers", "kimi-linear-graph-buffers", "k3.1"],
)
def test_greedy_outputs_equal_synchronous_scheduling(make_llm, model, prefix_caching, graphs):
    ps = prompts(12, 1, 120) + [[7]]
    params = [SamplingParams(temperature=0.0, max_tokens=n) for n in (1, 2, 5, 17, 40) * 2 + (9, 3, 30)]
    sync, async_ = both(make_llm, ps, params, model=model, enable_prefix_caching=prefix_caching, static_decode_buffers=graphs)
    assert async_ == sync


def test_seeded_sampling_and_n_equal_synchronous_scheduling(make_llm):
    params = SamplingParams(temperature=0.9, top_p=0.9, seed=11, n=2, max_tokens=24, logprobs=2)
    ps = prompts(5, 3, 40, seed=1)
    sync = make_llm().generate(ps, params, use_tqdm=False)
    async_ = make_llm(async_scheduling=True).generate(ps, params, use_tqdm=False)
    assert completions(async_) == completions(sync)
    assert [c.logprobs for o in async_ for c in o.outputs] == [c.logprobs for o in sync for c in o.outputs]


def test_every_stop_condition_drops_the_token_computed_after_it(make_llm):
    """A request that stops at step k still had a token computed in step k+1: it must not show."""
    ps = prompts(6, 5, 30, seed=2)
    first = make_llm().generate(ps, SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)
    # stop on tokens and text the greedy run really produces, at different steps per request
    params = [
        SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[o.outputs[0].token_ids[3]]) for o in first[:2]
    ] + [
        SamplingParams(temperature=0.0, max_tokens=30, stop=[o.outputs[0].text[2:4] or "x"]) for o in first[2:4]
    ] + [
        SamplingParams(temperature=0.0, max_tokens=30, min_tokens=6, stop_token_ids=[o.outputs[0].token_ids[7]])
        for o in first[4:]
    ]
    sync, async_ = both(make_llm, ps, params)
    assert async_ == sync
    assert sum(reason == "stop" for _, _, reason in async_) >= 4  # text may be too short to hold a stop string


def test_eos_stops_as_in_synchronous_scheduling(make_llm):
    ps = prompts(8, 2, 50, seed=3)
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=60, logit_bias={EOS: 4.0})
    sync, async_ = both(make_llm, ps, params)
    assert async_ == sync
    assert any(reason == "stop" for _, _, reason in async_)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preemption_with_a_token_in_flight_keeps_outputs(make_llm, prefix_caching):
    ps = prompts(8, 20, 60, seed=4)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    roomy = make_llm(enable_prefix_caching=prefix_caching).generate(ps, params, use_tqdm=False)
    small = make_llm(async_scheduling=True, enable_prefix_caching=prefix_caching, num_gpu_blocks=12)
    outs = small.generate(ps, params, use_tqdm=False)
    assert small.engine.scheduler.num_preemptions > 0
    assert completions(outs) == completions(roomy)


def test_chunked_prefill_keeps_outputs(make_llm):
    ps = prompts(6, 1, 40, seed=5)
    sync, async_ = both(make_llm, ps, SamplingParams(temperature=0.0, max_tokens=10), max_num_batched_tokens=7)
    assert async_ == sync


def test_penalties_and_structured_outputs_wait_for_the_previous_token(make_llm, tiny_model):
    _, tok = tiny_model("k3-tiny")
    end = [EOS]
    choice = compile_spec(StructuredSpec("choice", ["yes", "no", "maybe"], end_token_ids=end), tok, tok.vocab_size)
    params = [
        SamplingParams(temperature=0.0, max_tokens=20, presence_penalty=1.5, frequency_penalty=0.5),
        SamplingParams(temperature=0.0, max_tokens=20, repetition_penalty=1.3),
        SamplingParams(temperature=0.0, max_tokens=20, structured=choice),
        SamplingParams(temperature=0.0, max_tokens=20),
    ]
    sync, async_ = both(make_llm, prompts(4, 5, 20, seed=6), params)
    assert async_ == sync
    assert async_[2][1] in ("yes", "no", "maybe")


def test_multi_turn_prefix_hits_equal_synchronous_scheduling(make_llm):
    """The prefix cache registers a request's blocks by token ids that async scheduling learns a step
    late: a follow-up turn must hit the same cache and give the same tokens."""
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    results = []
    for mode in (False, True):
        llm = make_llm(async_scheduling=mode)
        turn = prompts(1, 70, 70, seed=7)[0]
        outs = []
        for _ in range(3):
            out = llm.generate([turn], params, use_tqdm=False)[0]
            outs.append((out.outputs[0].token_ids, out.num_cached_tokens))
            turn = turn + out.outputs[0].token_ids + [10, 11, 12]
        results.append(outs)
    assert results[1] == results[0]
    assert results[1][-1][1] > 0


def test_the_next_step_launches_before_the_previous_tokens_are_read(make_engine):
    """What makes it async: during step k+1's forward, step k's token is still pending on the host."""
    engine = make_engine(async_scheduling=True, enable_prefix_caching=False)  # one prefill chunk
    seen = []
    real = engine.runner.execute

    def watch(out, pending=None):
        seen.append([(len(s.req.output_token_ids), s.req.num_pending) for s in out.seqs])
        return real(out, pending)

    engine.runner.execute = watch
    engine.add_request("a", [1, 2, 3, 4], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert seen[0] == [(0, 0)]  # the prefill: nothing in flight yet
    assert seen[1] == [(0, 1)]  # the first decode runs while the prefill's token is still on the device
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 4
    assert_pool_empty(engine)


def test_abort_with_a_token_in_flight_frees_everything(make_engine):
    engine = make_engine(async_scheduling=True)
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    for i, p in enumerate(prompts(3, 20, 40, seed=8)):
        engine.add_request(str(i), p, params)
    for _ in range(6):
        engine.step()
    assert any(r.num_pending for r in engine.scheduler.running)
    engine.abort_request("1")
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    done = {o.request_id: o for o in outs if o.finished}
    assert set(done) == {"0", "2"} and all(len(o.outputs[0].token_ids) == 50 for o in done.values())
    assert_pool_empty(engine)


def test_async_scheduling_flag_reaches_the_engine_config():
    import argparse

    from hyserve.entrypoints.engine_args import add_engine_arguments, engine_kwargs_from_args

    p = argparse.ArgumentParser()
    add_engine_arguments(p)
    assert engine_kwargs_from_args(p.parse_args(["--async-scheduling"])) == {"async_scheduling": True}
    assert "async_scheduling" not in engine_kwargs_from_args(p.parse_args([]))
