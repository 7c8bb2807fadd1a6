"""The engine end to end on tiny float32 presets: batching, preemption and chunking never change outputs;
requests fail alone; stop conditions, logprobs and n behave like vLLM's offline API."""

from __future__ import annotations

import gc
import random
import weakref

import pytest
import torch
from conftest import assert_pool_empty

from hyserve import LLM, SamplingParams
from hyserve.config import EngineConfig
from hyserve.engine.llm_engine import LLMEngine

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
LETTERS = {ord(c): 30.0 for c in "abcdefghijklmnopqrstuvwxyz"}  # force plain ASCII text
EOS = 258  # the byte tokenizer's [EOS]; the tiny presets' eos_token_id


def random_prompts(n: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def run_alone(llm, prompts, params) -> list[list[int]]:
    return [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]


# ---- batching never changes outputs --------------------------------------------------------------


@pytest.mark.parametrize(
    "model, prefix_caching",
    [("k3-tiny", True), ("k3-tiny", False), ("kimi-linear-tiny", True)],
)
def test_batched_greedy_outputs_equal_each_request_run_alone(make_llm, model, prefix_caching):
    prompts = random_prompts(30, 1, 300) + [[7], random_prompts(1, 300, 300, seed=1)[0]]
    alone = run_alone(make_llm(model, enable_prefix_caching=prefix_caching), prompts, GREEDY)
    batched = make_llm(model, enable_prefix_caching=prefix_caching).generate(prompts, GREEDY, use_tqdm=False)
    assert token_ids(batched) == alone


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_outputs_unchanged_when_a_small_cache_forces_preemption(make_llm, prefix_caching):
    prompts = random_prompts(8, 20, 60, seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    roomy = make_llm(enable_prefix_caching=prefix_caching).generate(prompts, params, use_tqdm=False)
    small = make_llm(enable_prefix_caching=prefix_caching, num_gpu_blocks=12)
    outs = small.generate(prompts, params, use_tqdm=False)
    assert small.engine.scheduler.num_preemptions > 0
    assert token_ids(outs) == token_ids(roomy)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_chunked_prefill_gives_the_same_outputs_as_unchunked(make_llm, prefix_caching):
    prompts = random_prompts(6, 1, 40, seed=3)
    whole = make_llm(enable_prefix_caching=prefix_caching).generate(prompts, GREEDY, use_tqdm=False)
    chunked = make_llm(enable_prefix_caching=prefix_caching, max_num_batched_tokens=7)
    assert token_ids(chunked.generate(prompts, GREEDY, use_tqdm=False)) == token_ids(whole)


def test_seeded_sampling_is_reproducible_across_batch_compositions(make_llm):
    target = random_prompts(1, 30, 30, seed=4)[0]
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=12, ignore_eos=True)
    alone = make_llm().generate([target], seeded, use_tqdm=False)[0].outputs[0].token_ids

    others = random_prompts(5, 1, 80, seed=5)
    other_params = [
        GREEDY,
        SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.7, top_p=0.9, seed=9, max_tokens=5),
        SamplingParams(temperature=1.0, top_k=5, max_tokens=12),
        GREEDY,
    ]
    mixed = make_llm(max_num_batched_tokens=24).generate(
        others[:2] + [target] + others[2:], other_params[:2] + [seeded] + other_params[2:], use_tqdm=False
    )
    assert mixed[2].outputs[0].token_ids == alone


# ---- aborts free everything ----------------------------------------------------------------------


def test_abort_during_prefill_frees_every_page_and_slot(make_engine):
    engine = make_engine(max_num_batched_tokens=16)
    engine.add_request("r", random_prompts(1, 100, 100)[0], GREEDY)
    engine.step()
    req = engine.parents["r"].children[0]
    assert 0 < req.num_computed_tokens < req.num_prompt_tokens
    engine.abort_request("r")
    assert_pool_empty(engine)


def test_abort_during_decode_frees_every_page_and_slot(make_engine):
    engine = make_engine()
    engine.add_request("r", random_prompts(1, 40, 40)[0], SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
    engine.add_request("s", [1, 2, 3], GREEDY)
    for _ in range(3):
        engine.step()
    req = engine.parents["r"].children[0]
    assert 0 < len(req.output_token_ids) < 50
    engine.abort_request("r")
    while engine.has_unfinished_requests():
        engine.step()
    assert_pool_empty(engine)


def test_a_failing_step_fails_its_requests_and_the_engine_keeps_serving(make_engine, monkeypatch):
    engine = make_engine()
    real = engine.runner.execute

    def broken(out, pending=None):
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr(engine.runner, "execute", broken)
    engine.add_request("bad", [1, 2, 3, 4], GREEDY)
    (failed,) = engine.step()
    assert failed.finished and "kernel exploded" in failed.error
    assert failed.outputs[0].finish_reason == "error"
    monkeypatch.setattr(engine.runner, "execute", real)
    engine.add_request("good", [1, 2, 3, 4], GREEDY)
    outs = []
    while engine.has_unfinished_requests():
        outs.extend(engine.step())
    assert outs[-1].finished and outs[-1].error is None and len(outs[-1].outputs[0].token_ids) == GREEDY.max_tokens
    assert_pool_empty(engine)


def test_n_greater_than_one_keeps_request_ids_that_contain_the_child_separator(make_engine):
    engine = make_engine()
    engine.add_request("user#7", [1, 2, 3], SamplingParams(n=2, temperature=0.0, max_tokens=3, ignore_eos=True))
    outs = []
    while engine.has_unfinished_requests():
        outs.extend(engine.step())
    assert {o.request_id for o in outs} == {"user#7"}
    assert outs[-1].finished and [len(c.token_ids) for c in outs[-1].outputs] == [3, 3]
    assert_pool_empty(engine)


def test_final_only_requests_emit_a_single_output(make_engine):
    from hyserve.sampling_params import RequestOutputKind

    engine = make_engine()
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)
    engine.add_request("r", [1, 2, 3], params)
    outs = []
    while engine.has_unfinished_requests():
        outs.extend(engine.step())
    assert len(outs) == 1 and outs[0].finished and len(outs[0].outputs[0].token_ids) == 5


# ---- a bad request fails alone -------------------------------------------------------------------


def test_prompt_longer_than_max_model_len_fails_only_that_request(make_llm):
    outs = make_llm(max_model_len=64).generate([[1] * 10, [2] * 100, [3] * 20], GREEDY, use_tqdm=False)
    assert "max_model_len" in outs[1].error
    assert outs[1].finished
    assert [o.error for o in (outs[0], outs[2])] == [None, None]
    assert [len(o.outputs[0].token_ids) for o in (outs[0], outs[2])] == [8, 8]


def test_out_of_vocabulary_parameter_fails_only_that_request(make_llm):
    bad = SamplingParams(max_tokens=4, logit_bias={100_000: 1.0})
    outs = make_llm().generate([[1, 2], [3, 4], [5, 6]], [GREEDY, bad, GREEDY], use_tqdm=False)
    assert "logit_bias" in outs[1].error
    assert outs[0].error is None and outs[2].error is None
    assert len(outs[2].outputs[0].token_ids) == 8


def test_out_of_vocabulary_prompt_token_fails_only_that_request(make_llm):
    outs = make_llm().generate([[1, 2], [3, 100_000]], GREEDY, use_tqdm=False)
    assert "out of range" in outs[1].error
    assert outs[0].outputs[0].finish_reason == "length"


@pytest.mark.parametrize("max_num_batched_tokens", [2048, 16])
def test_prompt_larger_than_the_whole_pool_fails_instead_of_hanging(make_llm, max_num_batched_tokens):
    llm = make_llm(num_gpu_blocks=4, max_num_batched_tokens=max_num_batched_tokens)  # 64 cache tokens
    outs = llm.generate([[1] * 100, [2] * 10], GREEDY, use_tqdm=False)
    assert "cache pages" in outs[0].error
    assert outs[1].error is None and len(outs[1].outputs[0].token_ids) == 8


# ---- logprobs ------------------------------------------------------------------------------------


@pytest.mark.parametrize("max_num_batched_tokens", [2048, 7])
def test_prompt_logprobs_equal_log_softmax_of_the_full_sequence_forward(make_llm, max_num_batched_tokens):
    llm = make_llm(max_num_batched_tokens=max_num_batched_tokens)
    prompt = random_prompts(1, 40, 40, seed=6)[0]
    out = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=2), use_tqdm=False)[0]
    ref = torch.log_softmax(llm.engine.model.score(prompt), -1)
    assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
    for i in range(1, len(prompt)):
        entry, row = out.prompt_logprobs[i], ref[i - 1]
        assert entry[prompt[i]].logprob == pytest.approx(row[prompt[i]].item(), abs=1e-4)
        assert entry[prompt[i]].rank == 1 + int((row > row[prompt[i]]).sum())
        assert set(row.topk(2).indices.tolist()) <= set(entry)


def test_sampled_logprobs_carry_ranks_and_the_top_k_of_the_model(make_llm):
    llm = make_llm()
    prompt = random_prompts(1, 20, 20, seed=7)[0]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3)
    comp = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    ref = torch.log_softmax(llm.engine.model.score(prompt + comp.token_ids), -1)
    for j, (tok, entry) in enumerate(zip(comp.token_ids, comp.logprobs)):
        row = ref[len(prompt) - 1 + j]
        assert entry[tok].rank == 1  # greedy takes the argmax
        assert entry[tok].logprob == pytest.approx(row[tok].item(), abs=1e-4)
        top = row.topk(3).indices.tolist()
        assert {t: entry[t].rank for t in top} == {t: r for r, t in enumerate(top, 1)}


# ---- n and stop conditions -----------------------------------------------------------------------


def test_n_gives_n_independent_completions(make_llm):
    params = SamplingParams(n=3, temperature=1.0, seed=0, max_tokens=8, ignore_eos=True)
    out = make_llm().generate([[1, 2, 3]], params, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 8 and c.finish_reason == "length" for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3


def test_n_greedy_completions_are_identical(make_llm):
    out = make_llm().generate([[1, 2, 3]], SamplingParams(n=2, temperature=0.0, max_tokens=8), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == out.outputs[1].token_ids


def letters_run(llm, **kw):
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logit_bias=LETTERS, **kw)
    return llm.generate([list(b"once upon a time")], params, use_tqdm=False)[0].outputs[0]


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_ends_the_text_with_or_without_the_stop_string(make_llm, include):
    llm = make_llm()
    free = letters_run(llm).text
    stop = free[5:7]
    at = free.index(stop)
    comp = letters_run(llm, stop=[stop], include_stop_str_in_output=include)
    assert comp.text == (free[: at + len(stop)] if include else free[:at])
    assert (comp.finish_reason, comp.stop_reason) == ("stop", stop)


def test_stop_token_id_ends_generation_and_is_the_stop_reason(make_llm):
    llm = make_llm()
    free = letters_run(llm).token_ids
    stop_tok = free[4]
    comp = letters_run(llm, stop_token_ids=[stop_tok])
    assert comp.token_ids == free[: free.index(stop_tok) + 1]
    assert (comp.finish_reason, comp.stop_reason) == ("stop", stop_tok)


def test_max_tokens_ends_with_finish_reason_length(make_llm):
    comp = make_llm().generate([[1, 2]], SamplingParams(max_tokens=5, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert (len(comp.token_ids), comp.finish_reason, comp.stop_reason) == (5, "length", None)


def test_eos_stops_generation(make_llm):
    params = SamplingParams(temperature=0.0, max_tokens=8, logit_bias={EOS: 100.0})
    comp = make_llm().generate([[1, 2]], params, use_tqdm=False)[0].outputs[0]
    assert (comp.token_ids, comp.finish_reason, comp.stop_reason) == ([EOS], "stop", None)


def test_min_tokens_holds_back_eos(make_llm):
    params = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=4, logit_bias={EOS: 100.0})
    comp = make_llm().generate([[1, 2]], params, use_tqdm=False)[0].outputs[0]
    assert EOS not in comp.token_ids[:4]
    assert comp.token_ids[4:] == [EOS] and comp.finish_reason == "stop"


def test_ignore_eos_generates_past_eos(make_llm):
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logit_bias={EOS: 100.0})
    comp = make_llm().generate([[1, 2]], params, use_tqdm=False)[0].outputs[0]
    assert (comp.token_ids, comp.finish_reason) == ([EOS] * 6, "length")


# ---- lifetime -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, graphs",
    [({}, False), ({"enable_prefix_caching": False}, False), ({"cpu_offload_bytes": 1 << 24}, False), ({}, True)],
    ids=["prefix-cache", "no-prefix-cache", "cpu-tier", "graph-buffers"],
)
def test_a_dropped_engine_frees_its_cache_pool_without_the_collector(tiny_model, kwargs, graphs):
    """On a GPU the pool is 90% of memory: `del llm` must give it back at once, so no reference cycle may
    hold it until the collector happens to run (a kernel or a second engine would run out of memory)."""
    weights, tok = tiny_model("k3-tiny")
    cfg = EngineConfig(model="k3-tiny", device="cpu", block_size=16, kv_cache_memory_bytes=32 << 20, **kwargs)
    gc.collect()
    gc.disable()
    try:
        engine = LLMEngine(cfg, model=weights, tokenizer=tok, static_decode_buffers=graphs)
        llm = LLM.from_engine(engine)
        llm.generate([[5, 6, 7] * 20, [9, 8]], GREEDY, use_tqdm=False)
        pool = weakref.ref(engine.kv.tensors)
        del engine, llm
        assert pool() is None
    finally:
        gc.enable()
