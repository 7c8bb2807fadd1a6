"""`LLM(..., skip_tokenizer_init=True)` (vLLM's): no tokenizer is loaded, so a checkpoint directory without
tokenizer files serves token ids in and token ids out."""

from __future__ import annotations

import os

import pytest

from hyserve import LLM, SamplingParams

# A K3 checkpoint with weights and config.json only: no tokenizer.json, no tiktoken.model.
BARE_CHECKPOINT = os.path.join(os.path.dirname(__file__), "data", "k3-public")


@pytest.fixture(scope="module")
def llm():
    return LLM(model=BARE_CHECKPOINT, skip_tokenizer_init=True, device="cpu", max_num_seqs=4)


def test_a_checkpoint_without_tokenizer_files_loads_with_skip_tokenizer_init(llm):
    assert not any(os.path.exists(os.path.join(BARE_CHECKPOINT, f)) for f in ("tokenizer.json", "tiktoken.model"))
    assert llm.get_tokenizer() is None


def test_token_ids_in_give_token_ids_out_with_empty_text(llm):
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}, [9, 10]], params, use_tqdm=False)
    for o in out:
        (c,) = o.outputs
        assert o.prompt is None and o.error is None
        assert len(c.token_ids) == 6 and all(0 <= t < 256 for t in c.token_ids)
        assert c.text == ""
        assert all(lp.decoded_token is None for row in c.logprobs for lp in row.values())
    assert out[0].prompt_token_ids == [5, 6, 7]


def test_greedy_ids_match_an_engine_that_has_a_tokenizer(llm):
    from hyserve.tokenizer import ByteTokenizer

    with_tok = LLM.from_engine(type(llm.engine)(llm.engine.cfg, model=llm.engine.model, tokenizer=ByteTokenizer("k3")))
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    a = llm.generate({"prompt_token_ids": [3, 4, 5]}, params, use_tqdm=False)[0].outputs[0].token_ids
    b = with_tok.generate({"prompt_token_ids": [3, 4, 5]}, params, use_tqdm=False)[0].outputs[0].token_ids
    assert a == b


@pytest.mark.parametrize("prompt", ["hello", {"prompt": "hello"}, ["a", [1, 2]]])
def test_a_text_prompt_is_a_clear_error(llm, prompt):
    with pytest.raises(ValueError, match="skip_tokenizer_init"):
        llm.generate(prompt, SamplingParams(max_tokens=2), use_tqdm=False)


def test_stop_strings_are_refused_without_a_tokenizer(llm):
    (out,) = llm.generate([1, 2, 3], SamplingParams(max_tokens=2, stop=["x"]), use_tqdm=False)
    assert out.error and "stop_token_ids" in out.error


def test_without_skip_tokenizer_init_the_bare_checkpoint_names_the_missing_files():
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        LLM(model=BARE_CHECKPOINT, device="cpu")
