"""The shipped embedded model (hyserve/assets/hyserve-tiny-k3): it loads, completes a fixed prompt the way it
did when shipped, and answers a tool-use chat with a parsed `lookup_symbol` call.

Skipped while no checkpoint is shipped. When one is, write its greedy completion of PROMPT into
tests/data/hyserve_tiny_k3_expected.json ({"prompt": ..., "completion": ...}).
"""

from __future__ import annotations

import json
import os
import random

import pytest

from hyserve.config import DEFAULT_MODEL, EMBEDDED_MODEL_DIR

EXPECTED = os.path.join(os.path.dirname(__file__), "data", "hyserve_tiny_k3_expected.json")

pytestmark = pytest.mark.skipif(
    not os.path.isfile(os.path.join(EMBEDDED_MODEL_DIR, "config.json")),
    reason="no trained checkpoint shipped in hyserve/assets/hyserve-tiny-k3 yet",
)


@pytest.fixture(scope="module")
def llm():
    from hyserve import LLM

    return LLM(max_num_seqs=4)


def test_the_shipped_model_is_the_default(llm):
    assert DEFAULT_MODEL == EMBEDDED_MODEL_DIR
    assert llm.engine.model_config.is_k3 and llm.get_tokenizer().vocab_size >= 8192


@pytest.mark.skipif(not os.path.isfile(EXPECTED), reason="no stored completion for the shipped checkpoint")
def test_a_fixed_greedy_completion_is_unchanged(llm):
    from hyserve import SamplingParams

    expected = json.load(open(EXPECTED))
    out = llm.generate(expected["prompt"], SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)
    assert out[0].outputs[0].text == expected["completion"]


def test_a_tool_use_chat_yields_a_lookup_symbol_call(llm):
    from hyserve import SamplingParams
    from hyserve.entrypoints.chat.k3_encoding import encode_k3
    from hyserve.train.data import LOOKUP_TOOL, Symbol, tool_messages
    from hyserve.train.evaluate import parsed_call

    tok = llm.get_tokenizer()
    sym = Symbol("json", "json.dumps", "dumps(obj)", "", "")
    prompt = encode_k3(tok, tool_messages(sym, random.Random(0), complete=False), [LOOKUP_TOOL])
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=64), use_tqdm=False)
    ok, name = parsed_call(tok, out[0].outputs[0].token_ids)
    assert ok and name == "json.dumps"
