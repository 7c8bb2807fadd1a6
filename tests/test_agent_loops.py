"""Tool loops the way coding agents run them, against the embedded model (hyserve-tiny-k3, which calls
`lookup_symbol` when it is offered and answers from the tool's result), through the official `openai`
(Responses) and `anthropic` (Messages) SDKs. The second turn of each loop resends the first one (by
`previous_response_id`, as items, or as Anthropic content blocks) and is served from the prefix cache past
the first turn's prompt: the model's own turn was rendered back to the ids it generated. After every test
the pool is empty again.
"""

from __future__ import annotations

import json
import os

import anthropic
import openai
import pytest

from hyserve.config import EMBEDDED_MODEL_DIR
from tests.agent_api_util import (
    JSON_DUMPS_DOC,
    LOOKUP_DESCRIPTION,
    LOOKUP_PARAMETERS,
    api_server,
    assert_pool_idle,
    sse_events,
)

pytestmark = pytest.mark.skipif(not os.path.isfile(os.path.join(EMBEDDED_MODEL_DIR, "config.json")),
                                reason="no trained checkpoint shipped in hyserve/assets/hyserve-tiny-k3")

MODEL = "hyserve-tiny-k3"
QUESTION = "What does json.dumps do?"
LOOKUP = {"type": "function", "name": "lookup_symbol", "description": LOOKUP_DESCRIPTION,
          "parameters": LOOKUP_PARAMETERS}
LOOKUP_ANTHROPIC = {"name": "lookup_symbol", "description": LOOKUP_DESCRIPTION, "input_schema": LOOKUP_PARAMETERS}
THINKING = {"type": "enabled", "budget_tokens": 1024}
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def server():
    with api_server(model=EMBEDDED_MODEL_DIR) as url:
        yield url


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(autouse=True)
def _pool_is_empty_after_each_test(server):
    yield
    assert_pool_idle(server)


def _lookup_call(response) -> object:
    assert [o.type for o in response.output] == ["reasoning", "function_call"], response.output
    call = response.output[1]
    assert call.name == "lookup_symbol" and json.loads(call.arguments) == {"name": "json.dumps"}
    return call


def test_responses_function_call_loop_by_previous_response_id(oai):
    first = oai.responses.create(model=MODEL, input=QUESTION, tools=[LOOKUP], temperature=0, max_output_tokens=96)
    call = _lookup_call(first)
    assert first.output[0].content[0].text and first.usage.output_tokens_details.reasoning_tokens > 0
    second = oai.responses.create(model=MODEL, previous_response_id=first.id, tools=[LOOKUP], temperature=0,
                                  max_output_tokens=96, input=[
                                      {"type": "function_call_output", "call_id": call.call_id, "output": JSON_DUMPS_DOC}])
    assert second.status == "completed" and "json.dumps(obj" in second.output_text
    assert second.usage.input_tokens_details.cached_tokens > first.usage.input_tokens


def test_responses_function_call_loop_with_explicit_items_and_no_store(oai):
    first = oai.responses.create(model=MODEL, input=QUESTION, tools=[LOOKUP], temperature=0, max_output_tokens=96,
                                 store=False, include=["reasoning.encrypted_content"])
    call = _lookup_call(first)
    reasoning = first.output[0]
    assert reasoning.encrypted_content
    items = [{"role": "user", "content": QUESTION},
             {"type": "reasoning", "id": reasoning.id, "summary": [], "encrypted_content": reasoning.encrypted_content},
             call.model_dump(exclude_none=True),
             {"type": "function_call_output", "call_id": call.call_id, "output": JSON_DUMPS_DOC}]
    second = oai.responses.create(model=MODEL, input=items, tools=[LOOKUP], temperature=0, max_output_tokens=96,
                                  store=False)
    assert "json.dumps(obj" in second.output_text
    assert second.usage.input_tokens_details.cached_tokens > first.usage.input_tokens


def test_responses_streamed_turn_has_reasoning_then_the_call(oai):
    with oai.responses.stream(model=MODEL, input=QUESTION, tools=[LOOKUP], temperature=0,
                              max_output_tokens=96) as stream:
        names = [e.type for e in stream]
        final = stream.get_final_response()
    _lookup_call(final)
    assert names.index("response.reasoning_text.delta") < names.index("response.function_call_arguments.delta")
    assert names[-1] == "response.completed"


def test_messages_tool_use_loop_with_thinking(claude):
    first = claude.messages.create(model=MODEL, max_tokens=2000, tools=[LOOKUP_ANTHROPIC], thinking=THINKING,
                                   messages=[{"role": "user", "content": QUESTION}], extra_body=GREEDY)
    assert [b.type for b in first.content] == ["thinking", "tool_use"] and first.stop_reason == "tool_use"
    thinking, use = first.content
    assert thinking.thinking and thinking.signature and use.input == {"name": "json.dumps"}
    second = claude.messages.create(
        model=MODEL, max_tokens=2000, tools=[LOOKUP_ANTHROPIC], thinking=THINKING, extra_body=GREEDY, messages=[
            {"role": "user", "content": QUESTION}, {"role": "assistant", "content": first.content},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": JSON_DUMPS_DOC}]}])
    assert second.stop_reason == "end_turn" and [b.type for b in second.content] == ["thinking", "text"]
    assert "json.dumps(obj" in second.content[1].text
    first_prompt = first.usage.input_tokens + first.usage.cache_read_input_tokens
    assert second.usage.cache_read_input_tokens > first_prompt


def test_messages_stream_with_thinking_streams_thinking_then_the_tool_input(server, claude):
    body = {"model": MODEL, "max_tokens": 2000, "tools": [LOOKUP_ANTHROPIC], "thinking": THINKING,
            "messages": [{"role": "user", "content": QUESTION}], **GREEDY}
    events = sse_events(server, "/v1/messages", {**body, "stream": True})
    deltas = [d["delta"]["type"] for n, d in events if n == "content_block_delta"]
    assert deltas[0] == "thinking_delta" and deltas[-2:] == ["signature_delta", "input_json_delta"]
    with claude.messages.stream(**{k: v for k, v in body.items() if k != "temperature"}, extra_body=GREEDY) as s:
        final = s.get_final_message()
    assert final.content[1].input == {"name": "json.dumps"} and final.stop_reason == "tool_use"


def test_messages_without_thinking_answer_in_text_only(claude):
    m = claude.messages.create(model=MODEL, max_tokens=64, messages=[{"role": "user", "content": QUESTION}],
                               extra_body=GREEDY)
    assert [b.type for b in m.content] == ["text"] and m.content[0].text
