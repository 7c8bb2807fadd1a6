"""The OpenAI Responses API (`/v1/responses`), specified through the official `openai` SDK against a live
k3-tiny server (random weights, so shapes and mechanics are checked here; answers that matter are in
test_agent_loops.py on the embedded model). The server stores at most 4 responses, to show eviction.
After every test the pool is empty again.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.agent_api_util import (
    LONG_FORMAT,
    WEATHER_PARAMETERS,
    abandon_while_it_runs,
    api_server,
    assert_pool_idle,
    nested_schema,
    post,
    sse_events,
    stream_then_disconnect,
)

MODEL = "k3-tiny"
NO_THINK = {"effort": "none"}
WEATHER = {"type": "function", "name": "get_weather", "parameters": WEATHER_PARAMETERS}
FORCED = {"tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False, "reasoning": NO_THINK,
          "max_output_tokens": 300}


@pytest.fixture(scope="module")
def server():
    with api_server("--responses-store-size", "4") as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(autouse=True)
def _pool_is_empty_after_each_test(server):
    yield
    assert_pool_idle(server)


def test_a_text_answer_is_one_message_item_with_usage(client):
    r = client.responses.create(model=MODEL, input="hello", max_output_tokens=6, temperature=0, reasoning=NO_THINK)
    assert r.object == "response" and r.model == MODEL and r.store is True
    (item,) = r.output
    assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"
    assert r.output_text == item.content[0].text != ""
    # cut by max_output_tokens: incomplete, as the vendor says it
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert item.status == "incomplete"
    u = r.usage
    assert u.output_tokens == 6 and u.total_tokens == u.input_tokens + 6 and u.output_tokens_details.reasoning_tokens == 0
    assert u.input_tokens_details.cached_tokens >= 0


def test_instructions_and_message_items_render_like_chat(client):
    items = [{"role": "developer", "content": "be brief"}, {"role": "user", "content": [
        {"type": "input_text", "text": "hel"}, {"type": "input_text", "text": "lo"}]}]
    r = client.responses.create(model=MODEL, input=items, max_output_tokens=1, reasoning=NO_THINK)
    chat = client.chat.completions.create(model=MODEL, max_tokens=1, messages=[
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}],
        extra_body={"chat_template_kwargs": {"thinking": False}})
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    r2 = client.responses.create(model=MODEL, instructions="be brief", input="hello", max_output_tokens=1,
                                 reasoning=NO_THINK)
    assert r2.usage.input_tokens == chat.usage.prompt_tokens and r2.instructions == "be brief"


def test_streaming_sends_the_event_sequence_and_the_text_of_the_plain_answer(server, client):
    body = {"model": MODEL, "input": "hello", "max_output_tokens": 8, "temperature": 0, "reasoning": NO_THINK}
    events = sse_events(server, "/v1/responses", {**body, "stream": True})
    names = [n for n, _ in events]
    assert names[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta"]
    assert names[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    assert all(d["type"] == n for n, d in events)
    text = "".join(d["delta"] for n, d in events if n == "response.output_text.delta")
    final = events[-1][1]["response"]
    assert final["output"][0]["content"][0]["text"] == text == client.responses.create(**body).output_text


def test_reasoning_is_a_reasoning_item_with_reasoning_text_events(server):
    events = sse_events(server, "/v1/responses", {"model": MODEL, "input": "hi", "max_output_tokens": 5,
                                                  "stream": True, "reasoning": {"effort": "low"}})
    names = [n for n, _ in events]
    assert "response.reasoning_text.delta" in names and "response.output_text.delta" not in names
    added = next(d for n, d in events if n == "response.output_item.added")
    assert added["item"]["type"] == "reasoning"
    final = events[-1][1]["response"]
    (item,) = final["output"]
    text = "".join(d["delta"] for n, d in events if n == "response.reasoning_text.delta")
    assert item["content"] == [{"type": "reasoning_text", "text": text}]
    assert final["usage"]["output_tokens_details"]["reasoning_tokens"] == 5


def test_a_forced_function_call_streams_its_arguments_and_the_sdk_accumulates_it(client):
    with client.responses.stream(model=MODEL, input="weather?", **FORCED) as stream:
        names = [e.type for e in stream]
        final = stream.get_final_response()
    assert "response.function_call_arguments.delta" in names and "response.function_call_arguments.done" in names
    assert names[-1] == "response.completed" and final.status == "completed"
    (call,) = final.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id
    assert json.loads(call.arguments)["city"].strip() in ("Paris", "Oslo")


def test_a_function_call_loop_continues_by_previous_response_id_or_by_items_alike(client):
    first = client.responses.create(model=MODEL, input="weather?", **FORCED)
    (call,) = first.output
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
    follow = {"tools": [WEATHER], "reasoning": NO_THINK, "max_output_tokens": 4}
    by_id = client.responses.create(model=MODEL, previous_response_id=first.id, input=[result], **follow)
    assert by_id.previous_response_id == first.id
    items = [{"role": "user", "content": "weather?"}, call.model_dump(exclude_none=True), result]
    by_items = client.responses.create(model=MODEL, input=items, **follow)
    assert by_items.usage.input_tokens == by_id.usage.input_tokens > first.usage.input_tokens
    # the same prompt again: the second one is served from the prefix cache
    assert by_items.usage.input_tokens_details.cached_tokens >= by_items.usage.input_tokens - 1


def test_json_schema_text_format_goes_through_structured_outputs(client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"}},
              "required": ["ok", "n"], "additionalProperties": False}
    r = client.responses.create(model=MODEL, input="json please", reasoning=NO_THINK, max_output_tokens=300,
                                text={"format": {"type": "json_schema", "name": "thing", "schema": schema}})
    value = json.loads(r.output_text)
    assert set(value) == {"ok", "n"} and isinstance(value["ok"], bool) and isinstance(value["n"], int)
    assert r.text.format.type == "json_schema"


def test_stored_responses_are_retrieved_and_deleted(client):
    r = client.responses.create(model=MODEL, input="keep me", max_output_tokens=2, reasoning=NO_THINK)
    got = client.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text and got.usage == r.usage
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model=MODEL, previous_response_id=r.id, input="more", max_output_tokens=2)
    assert e.value.body["param"] == "previous_response_id"


def test_store_false_keeps_nothing(client):
    r = client.responses.create(model=MODEL, input="forget me", max_output_tokens=2, store=False, reasoning=NO_THINK)
    assert r.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)


def test_an_evicted_turn_answers_404_naming_it(client):
    """The store keeps 4 responses here: the oldest turn of a chain goes first, and continuing any later
    turn of that chain then answers 404 naming the missing one."""
    first = client.responses.create(model=MODEL, input="one", max_output_tokens=1, reasoning=NO_THINK)
    second = client.responses.create(model=MODEL, input="two", previous_response_id=first.id, max_output_tokens=1,
                                     reasoning=NO_THINK)
    for i in range(3):
        client.responses.create(model=MODEL, input=f"filler {i}", max_output_tokens=1, reasoning=NO_THINK)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model=MODEL, previous_response_id=second.id, input="three", max_output_tokens=1)
    assert first.id in e.value.message and "evicted" in e.value.message
    assert client.responses.retrieve(second.id).id == second.id


def test_input_tokens_counts_what_create_would_render(client):
    kwargs = {"input": "count me", "instructions": "be brief", "tools": [WEATHER], "reasoning": NO_THINK}
    counted = client.responses.input_tokens.count(model=MODEL, **kwargs)
    r = client.responses.create(model=MODEL, max_output_tokens=1, **kwargs)
    assert counted.input_tokens == r.usage.input_tokens


def test_reasoning_encrypted_content_carries_the_reasoning_back_statelessly(client):
    first = client.responses.create(model=MODEL, input="hi", max_output_tokens=3, store=False,
                                    include=["reasoning.encrypted_content"], reasoning={"effort": "low"})
    (item,) = first.output
    assert item.type == "reasoning" and item.encrypted_content
    opaque = {"type": "reasoning", "id": item.id, "summary": [], "encrypted_content": item.encrypted_content}
    plain = {"type": "reasoning", "id": item.id, "summary": [], "content": [c.model_dump() for c in item.content]}
    counts = [client.responses.input_tokens.count(model=MODEL, reasoning={"effort": "low"}, input=[
        {"role": "user", "content": "hi"}, reasoning, {"role": "user", "content": "and?"}]).input_tokens
        for reasoning in (opaque, plain)]
    assert counts[0] == counts[1]


def test_disconnect_mid_stream_aborts_the_request(server):
    body = {"model": MODEL, "input": "x" * 500, "max_output_tokens": 3000, "stream": True, "reasoning": NO_THINK,
            "text": {"format": {"name": "long", **LONG_FORMAT}}}
    stream_then_disconnect(server, "/v1/responses", body)


def test_disconnect_while_waiting_for_a_non_streaming_response_aborts_it_and_frees_its_cache(server):
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 3000, "reasoning": NO_THINK,
            "text": {"format": {"name": "long", **LONG_FORMAT}}}
    abandon_while_it_runs(server, "/v1/responses", body)


WEB = {"type": "web_search"}
BAD_REQUESTS = [
    # (body, status, param, substring of the message)
    ({"model": MODEL}, 400, "input", "input"),
    ({"input": "hi", "max_output_tokens": "8"}, 400, "max_output_tokens", "integer"),
    ({"input": "hi", "stream": "yes"}, 400, "stream", "boolean"),
    ({"input": "hi", "temperature": 2.5}, 400, "temperature", "temperature"),
    ({"input": "hi", "top_p": 0}, 400, "top_p", "top_p"),
    ({"input": "hi", "max_output_tokens": 0}, 400, "max_output_tokens", "max_output_tokens"),
    ({"input": "hi", "model": "gpt-9"}, 404, "model", "does not exist"),
    ({"input": "x" * 5000}, 400, "input", "maximum context length"),
    ({"input": "hi", "max_output_tokens": 5000}, 400, "max_output_tokens", "maximum context length"),
    ({"input": "hi", "previous_response_id": "resp-nope"}, 404, "previous_response_id", "not found"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:,"}]}]}, 400, "input", "input_image"),
    ({"input": [{"type": "computer_call_output", "call_id": "c", "output": {}}]}, 400, "input", "computer_call_output"),
    ({"input": [{"type": "function_call_output", "output": "orphan"}]}, 400, "input", "tool name"),
    ({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "gAAAA"}]}, 400, "input", "encrypted_content"),
    ({"input": "hi", "tools": [WEB]}, 400, "tools", "web_search"),
    ({"input": "hi", "tools": [{**WEATHER, "name": "bad name"}]}, 400, "tools", "pattern"),
    ({"input": "hi", "tool_choice": "required"}, 400, "tool_choice", "tool"),
    ({"input": "hi", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, 400, "tool_choice", "nope"),
    ({"input": "hi", "tools": [WEATHER], "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}},
     400, "tool_choice", "allowed_tools"),
    ({"input": "hi", "reasoning": {"effort": "medium"}}, 400, "input", "thinking_effort"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, 400, "text", "schema"),
    ({"input": "hi", "text": {"verbosity": "low"}}, 400, "text.verbosity", "verbosity"),
    ({"input": "hi", "background": True}, 400, "background", "background"),
    ({"input": "hi", "truncation": "auto"}, 400, "truncation", "truncation"),
    ({"input": "hi", "include": ["message.output_text.logprobs"]}, 400, "include", "logprobs"),
    (b'{"input": "\\ud800"}', 400, "input", "surrogates not allowed"),
    (b'{"input": ', 400, None, "Invalid JSON"),
    (b'{"input": "hi", "temperature": NaN}', 400, "temperature", "temperature"),
    (b'{"input": "\xff\xfe"}', 400, None, "parsing the body"),
    # the API edge's limits (hyserve/entrypoints/openai/limits.py), as on the chat path
    (b'{"input": "hi", "instructions": "\\udfff"}', 400, "instructions", "instructions is not valid Unicode"),
    (b'{"input": [{"type": "function_call_output", "call_id": "c", "output": "\\ud800"}]}', 400, "input",
     "input[0].output is not valid Unicode"),
    ({"input": "hi", "tools": [{**WEATHER, "parameters": nested_schema(150)}]}, 400, "tools",
     "tools nests deeper than 64 levels"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": nested_schema(150)}}}, 400,
     "text", "text nests deeper than 64"),
    (b'{"input": ' + b'[' * 100_000 + b']' * 100_000 + b'}', 400, None, "parsing the body"),
    ({"input": "hi", "prompt": {"id": "p"}}, 400, "prompt", "prompt templates"),
    ({"input": "hi", "conversation": "c"}, 400, "conversation", "conversations are not supported"),
    ({"input": "hi", "top_logprobs": 2}, 400, "top_logprobs", "logprobs"),
]


@pytest.mark.parametrize(("body", "status", "param", "needle"), BAD_REQUESTS, ids=[str(i) for i in range(len(BAD_REQUESTS))])
def test_bad_requests_answer_4xx_in_the_openai_shape_and_the_server_keeps_serving(server, client, body, status,
                                                                                  param, needle):
    r = post(server, "/v1/responses", body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle.lower() in err["message"].lower(), err
    assert err["code"] == status and err["type"] and (param is None or (err["param"] or "").startswith(param)), err
    assert client.responses.create(model=MODEL, input="ok", max_output_tokens=1).status in ("completed", "incomplete")


def test_unknown_response_ids_answer_404(server):
    for method in ("GET", "DELETE"):
        r = httpx.request(method, f"{server}/v1/responses/resp-x")
        assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"
