"""Structured outputs with thinking on, the K3 default, through a live server on k3-tiny (serving.md §3).

The constraint covers the whole assistant turn: thinking is free text that cannot end the message, and the
message ends only after the constrained answer (or the forced calls). Random weights are the harshest
client: a completion that stops must have its answer; one that runs out of tokens says "length".
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from tests.server_util import live_server

MODEL = "k3-tiny"
SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "blue"]}, "n": {"type": "integer", "minimum": 0,
                                                                                       "maximum": 9}},
          "required": ["color", "n"], "additionalProperties": False}
PICK = {"type": "function", "function": {"name": "pick", "parameters": SCHEMA}}


@pytest.fixture(scope="module")
def server():
    with live_server("--max-num-seqs", "16") as url:
        yield url


def chat(server: str, **body) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "pick one"}], "max_tokens": 700, **body}
    r = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def test_json_schema_with_thinking_on_stops_only_after_the_answer(server):
    reply = chat(server, n=12, seed=1, response_format={"type": "json_schema",
                                                          "json_schema": {"name": "pick", "schema": SCHEMA}})
    stopped = [c for c in reply["choices"] if c["finish_reason"] == "stop"]
    assert stopped, "no completion finished within max_tokens: the test would check nothing"
    for c in stopped:
        jsonschema.validate(json.loads(c["message"]["content"]), SCHEMA)
        assert isinstance(c["message"]["reasoning"], str)
    assert all(c["finish_reason"] in ("stop", "length") for c in reply["choices"])


def test_forced_tool_call_with_thinking_on_stops_only_after_the_call(server):
    reply = chat(server, n=8, seed=2, tools=[PICK], tool_choice="required", parallel_tool_calls=False)
    called = [c for c in reply["choices"] if c["finish_reason"] == "tool_calls"]
    assert called, "no completion finished within max_tokens: the test would check nothing"
    for c in called:
        (call,) = c["message"]["tool_calls"]
        assert call["function"]["name"] == "pick"
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMA)
    assert all(c["finish_reason"] in ("tool_calls", "length") for c in reply["choices"])


def test_a_schema_keyword_the_grammar_cannot_enforce_is_a_400_naming_it(server):
    schema = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
            "response_format": {"type": "json_schema", "json_schema": {"name": "ids", "schema": schema}}}
    r = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400
    assert "uniqueItems" in r.json()["error"]["message"]
