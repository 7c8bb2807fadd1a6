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
def test_a_fixed_greedy_completion_is_unchanged():
    """In float32: a bf16 forward's near-ties fall differently on CPUs with and without bf16 instructions."""
    from hyserve import LLM, SamplingParams

    expected = json.load(open(EXPECTED))
    out = LLM(dtype="float32", max_num_seqs=1).generate(expected["prompt"], SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)
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


LOOKUP_TOOL_API = {
    "type": "function",
    "function": {"name": "lookup_symbol", "description": "Look up a Python standard library function or class.",
                 "parameters": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}},
}


@pytest.fixture(scope="module")
def server():
    from tests.server_util import live_server

    with live_server(model=EMBEDDED_MODEL_DIR) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)


def test_a_live_server_answers_a_tool_use_chat_with_a_parsed_tool_call(client):
    r = client.chat.completions.create(
        model="hyserve-tiny-k3", messages=[{"role": "user", "content": "What does json.dumps do?"}],
        tools=[LOOKUP_TOOL_API], temperature=0, max_tokens=96)
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and calls and calls[0].function.name == "lookup_symbol"
    assert json.loads(calls[0].function.arguments) == {"name": "json.dumps"}


def test_a_live_server_answers_a_plain_question_with_the_signature(client):
    r = client.chat.completions.create(
        model="hyserve-tiny-k3", messages=[{"role": "user", "content": "What does json.dumps do?"}],
        temperature=0, max_tokens=96)
    assert "json.dumps(obj" in r.choices[0].message.content


def test_the_server_evaluation_counts_calls_names_and_signatures(server, tmp_path):
    import dataclasses

    from hyserve.train.data import collect_symbols
    from hyserve.train.evaluate_server import evaluate_server

    syms = [s for s in collect_symbols(["json"]) if s.name in ("json.dumps", "json.loads")]
    split = tmp_path / "split.json"
    split.write_text(json.dumps({"eval_symbols": [dataclasses.asdict(s) for s in syms]}))
    res = evaluate_server(server, str(split), n=2, concurrency=2)
    assert res["n"] == 2 and res["tool_call"] == 1.0 and res["right_name"] == 1.0
    assert 0.0 <= res["signature"] <= 1.0


def test_loading_a_sharded_checkpoint_shows_a_progress_bar(capsys):
    from hyserve.models.loader import load_model

    load_model(EMBEDDED_MODEL_DIR)
    assert "Loading safetensors checkpoint shards: 100%" in capsys.readouterr().err


def test_a_live_server_answers_json_schema_with_thinking_on_after_its_reasoning(client):
    schema = {"type": "object", "properties": {"symbol": {"type": "string", "maxLength": 40}},
              "required": ["symbol"], "additionalProperties": False}
    r = client.chat.completions.create(
        model="hyserve-tiny-k3", messages=[{"role": "user", "content": "What does json.dumps do?"}], temperature=0,
        max_tokens=160, response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}})
    choice = r.choices[0]
    assert choice.finish_reason == "stop" and choice.message.model_extra.get("reasoning")
    value = json.loads(choice.message.content)
    assert set(value) == {"symbol"} and len(value["symbol"]) <= 40


def test_a_live_server_forced_tool_call_with_thinking_on_names_the_symbol(client):
    r = client.chat.completions.create(
        model="hyserve-tiny-k3", messages=[{"role": "user", "content": "What does json.dumps do?"}],
        tools=[LOOKUP_TOOL_API], tool_choice="required", temperature=0, max_tokens=96)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.model_extra.get("reasoning")
    assert json.loads(choice.message.tool_calls[0].function.arguments) == {"name": "json.dumps"}


# ---- what the model says about itself, and natural tool requests ----------------------------------------
# Run 7 (the shipped checkpoint) trained on tool requests composed from parts (small_talk.TOOL_REQUESTS);
# the phrasings below are held out of its data (docs/BENCHMARKS.md has the run-by-run rates).


@pytest.mark.parametrize("tools", [False, True], ids=["no-tools", "lookup-tool"])
def test_hello_who_are_you_is_answered_with_what_the_model_is_and_can_do(llm, tools):
    from hyserve import SamplingParams
    from hyserve.entrypoints.chat.k3_encoding import encode_k3
    from hyserve.entrypoints.chat.tool_calls import make_output_parser
    from hyserve.train.data import LOOKUP_TOOL
    from hyserve.train.evaluate import identity_reply_ok

    tok = llm.get_tokenizer()
    prompt = encode_k3(tok, [{"role": "user", "content": "Hello! Who are you?"}], [LOOKUP_TOOL] if tools else None)
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=160, skip_special_tokens=False),
                       use_tqdm=False)[0].outputs[0]
    parsed = make_output_parser("k3", tok, prompt_opens_thinking=True, tools_enabled=True).parse(out.token_ids)
    assert out.finish_reason == "stop" and identity_reply_ok(parsed.content or "", bool(parsed.tool_calls)), parsed


def test_natural_tool_requests_name_the_right_common_symbol_at_least_80_percent_of_the_time():
    from hyserve import LLM
    from hyserve.train.evaluate import tool_phrasing_rate

    rate = tool_phrasing_rate(LLM(max_num_seqs=100))
    assert rate >= 0.8, f"{rate:.0%} of 'Use lookup_symbol to find out what X does.'-style requests named X"
