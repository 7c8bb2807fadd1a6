"""The Anthropic Messages API (`/v1/messages`), specified through the official `anthropic` SDK against a live
k3-tiny server started with `--api-key` (random weights: shapes and mechanics here; answers that matter are
in test_agent_loops.py on the embedded model). After every test the pool is empty again.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest

from tests import agent_api_util as api

MODEL = "k3-tiny"
KEY = "sekrit"
AUTH = {"x-api-key": KEY}
GREEDY = {"temperature": 0}  # the SDK dropped `temperature`; the API still takes it
HI = [{"role": "user", "content": "hello"}]
WEATHER = {"name": "get_weather", "description": "The weather in a city.", "input_schema": api.WEATHER_PARAMETERS}


@pytest.fixture(scope="module")
def server():
    with api.api_server("--api-key", KEY) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server, api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(autouse=True)
def _pool_is_empty_after_each_test(server):
    yield
    api.assert_pool_idle(server)


def test_the_api_key_comes_as_x_api_key_or_bearer_token(server):
    body = {"model": MODEL, "max_tokens": 1, "messages": HI}
    missing = api.post(server, "/v1/messages", body)
    assert missing.status_code == 401
    assert missing.json() == {"type": "error", "error": {"type": "authentication_error",
                                                         "message": "Invalid or missing API key."}}
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server, api_key="wrong", max_retries=0).messages.create(**body)
    bearer = anthropic.Anthropic(base_url=server, auth_token=KEY, max_retries=0)
    assert bearer.messages.create(**body).stop_reason
    assert api.post(server, "/v1/messages", body, AUTH).status_code == 200


def test_a_text_answer_with_usage_and_stop_reason(client):
    m = client.messages.create(model=MODEL, max_tokens=5, messages=HI, extra_body=GREEDY)
    assert m.type == "message" and m.role == "assistant" and m.model == MODEL
    (block,) = m.content
    assert block.type == "text" and block.text
    assert m.stop_reason == "max_tokens" and m.stop_sequence is None
    u = m.usage
    assert u.output_tokens == 5 and u.cache_creation_input_tokens == 0
    # Anthropic counts cache reads apart: the prompt is input_tokens + cache_read_input_tokens
    assert u.input_tokens + u.cache_read_input_tokens == client.messages.count_tokens(model=MODEL, messages=HI).input_tokens


def test_a_repeated_prompt_reads_the_prefix_cache(client):
    messages = [{"role": "user", "content": "the same question twice"}]
    client.messages.create(model=MODEL, max_tokens=1, messages=messages)
    again = client.messages.create(model=MODEL, max_tokens=1, messages=messages)
    assert again.usage.cache_read_input_tokens > 0 and again.usage.input_tokens >= 1


def test_a_stop_sequence_ends_the_answer(client):
    base = client.messages.create(model=MODEL, max_tokens=24, messages=HI, extra_body=GREEDY).content[0].text
    # one punctuation character: it cannot straddle a special token (random weights write those too), whose
    # text holds only letters and `<|>[]_`
    stop = next((c for c in base[1:] if c.isprintable() and not c.isalnum() and c not in "<|>[]_ \ufffd"), None)
    assert stop is not None, base
    m = client.messages.create(model=MODEL, max_tokens=24, messages=HI, stop_sequences=[stop], extra_body=GREEDY)
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert m.content[0].text == base[: base.index(stop)]


def test_streaming_sends_anthropic_events_and_the_sdk_accumulates_them(server, client):
    body = {"model": MODEL, "max_tokens": 6, "messages": HI, **GREEDY}
    events = api.sse_events(server, "/v1/messages", {**body, "stream": True}, AUTH)
    names = [n for n, _ in events]
    assert names[:4] == ["message_start", "ping", "content_block_start", "content_block_delta"]
    assert names[-4:] == ["content_block_delta", "content_block_stop", "message_delta", "message_stop"]
    assert all(d["type"] == n for n, d in events)
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and "input_tokens" in start["usage"]
    delta = events[-2][1]
    assert delta["delta"]["stop_reason"] == "max_tokens" and delta["usage"]["output_tokens"] == 6
    text = "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta")
    with client.messages.stream(**{k: v for k, v in body.items() if k != "temperature"}, extra_body=GREEDY) as s:
        final = s.get_final_message()
    answer = client.messages.create(**{k: v for k, v in body.items() if k != "temperature"}, extra_body=GREEDY)
    assert final.content[0].text == text == answer.content[0].text


def test_a_forced_tool_use_streams_its_input_as_json(server, client):
    body = {"model": MODEL, "max_tokens": 300, "messages": [{"role": "user", "content": "weather?"}],
            "tools": [WEATHER], "tool_choice": {"type": "any", "disable_parallel_tool_use": True}}
    events = api.sse_events(server, "/v1/messages", {**body, "stream": True}, AUTH)
    start = next(d for n, d in events if n == "content_block_start")
    assert start["content_block"]["type"] == "tool_use" and start["content_block"]["input"] == {}
    (partial,) = [d["delta"]["partial_json"] for n, d in events if n == "content_block_delta"]
    assert json.loads(partial)["city"].strip() in ("Paris", "Oslo")
    with client.messages.stream(**body) as s:
        final = s.get_final_message()
    (use,) = final.content
    assert final.stop_reason == "tool_use" and use.type == "tool_use" and use.name == "get_weather"
    assert use.id and use.input["city"].strip() in ("Paris", "Oslo")


def test_a_named_tool_choice_calls_that_tool_and_none_calls_nothing(client):
    other = {"name": "get_time", "input_schema": {"type": "object", "properties": {"zone": {"enum": ["UTC"]}},
                                                  "required": ["zone"]}}
    m = client.messages.create(model=MODEL, max_tokens=300, tools=[WEATHER, other], messages=HI,
                               tool_choice={"type": "tool", "name": "get_time", "disable_parallel_tool_use": True})
    assert [b.name for b in m.content if b.type == "tool_use"] == ["get_time"] and m.stop_reason == "tool_use"
    m = client.messages.create(model=MODEL, max_tokens=8, tools=[WEATHER], messages=HI, tool_choice={"type": "none"})
    assert all(b.type == "text" for b in m.content) and m.stop_reason != "tool_use"


def test_a_tool_use_and_tool_result_loop_renders_like_chat(client):
    first = client.messages.create(model=MODEL, max_tokens=300, tools=[WEATHER],
                                   messages=[{"role": "user", "content": "weather?"}],
                                   tool_choice={"type": "any", "disable_parallel_tool_use": True})
    (use,) = first.content
    follow = [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": first.content},
              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}]}]
    second = client.messages.create(model=MODEL, max_tokens=3, tools=[WEATHER], messages=follow)
    chat = httpx.post(f"{client.base_url}/v1/chat/completions", headers=AUTH, timeout=60, json={
        "model": MODEL, "max_tokens": 1, "tools": [{"type": "function", "function": {
            "name": WEATHER["name"], "description": WEATHER["description"], "parameters": api.WEATHER_PARAMETERS}}],
        "chat_template_kwargs": {"thinking": False}, "messages": [
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": "", "tool_calls": [{"id": use.id, "type": "function", "function": {
                "name": use.name, "arguments": json.dumps(use.input)}}]},
            {"role": "tool", "tool_call_id": use.id, "content": "sunny"}]}).json()
    u = second.usage
    assert u.input_tokens + u.cache_read_input_tokens == chat["usage"]["prompt_tokens"]
    # the chat request came second, with the same prompt: served from the cache
    assert chat["usage"]["prompt_tokens_details"]["cached_tokens"] >= chat["usage"]["prompt_tokens"] - 1


def test_thinking_on_gives_thinking_blocks_and_off_gives_none(server):
    on = api.sse_events(server, "/v1/messages", {"model": MODEL, "max_tokens": 1100, "messages": HI, "stream": True,
                                             "thinking": {"type": "enabled", "budget_tokens": 1024},
                                             "output_config": {"effort": "low"}}, AUTH)
    start = next(d for n, d in on if n == "content_block_start")
    assert start["content_block"]["type"] == "thinking"
    kinds = [d["delta"]["type"] for n, d in on if n == "content_block_delta"]
    assert "thinking_delta" in kinds and "signature_delta" in kinds
    off = api.post(server, "/v1/messages", {"model": MODEL, "max_tokens": 4, "messages": HI}, AUTH).json()
    assert [b["type"] for b in off["content"]] == ["text"]


def test_a_final_assistant_message_is_continued(client):
    prefill = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "Hel"}]
    m = client.messages.create(model=MODEL, max_tokens=3, messages=prefill, extra_body=GREEDY)
    plain = client.messages.count_tokens(model=MODEL, messages=HI).input_tokens
    assert m.content[0].type == "text" and m.usage.input_tokens + m.usage.cache_read_input_tokens > plain


def test_output_config_format_constrains_the_answer_to_the_schema(client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    m = client.messages.create(model=MODEL, max_tokens=200, messages=HI,
                               extra_body={"output_config": {"format": {"type": "json_schema", "schema": schema}}})
    assert isinstance(json.loads(m.content[0].text)["ok"], bool)


def test_count_tokens_counts_system_tools_and_messages(client):
    bare = client.messages.count_tokens(model=MODEL, messages=HI).input_tokens
    full = client.messages.count_tokens(model=MODEL, messages=HI, system=[{"type": "text", "text": "be brief"}],
                                        tools=[WEATHER]).input_tokens
    assert full > bare > 0


def test_disconnect_mid_stream_aborts_the_request(server):
    body = {"model": MODEL, "max_tokens": 3000, "messages": [{"role": "user", "content": "x" * 500}], "stream": True,
            "output_config": {"format": api.LONG_FORMAT}}
    api.stream_then_disconnect(server, "/v1/messages", body, AUTH)


def test_disconnect_while_waiting_for_a_non_streaming_message_aborts_it_and_frees_its_cache(server):
    body = {"model": MODEL, "max_tokens": 3000, "messages": TEXT, "output_config": {"format": api.LONG_FORMAT}}
    api.abandon_while_it_runs(server, "/v1/messages", body, AUTH)


TEXT = [{"role": "user", "content": "hi"}]
OK = {"model": MODEL, "max_tokens": 4, "messages": TEXT}
BAD_REQUESTS = [
    # (body, status, error type, substring of the message)
    ({"model": MODEL, "messages": TEXT}, 400, "invalid_request_error", "max_tokens: Field required"),
    ({**OK, "max_tokens": "8"}, 400, "invalid_request_error", "max_tokens"),
    ({**OK, "stream": "yes"}, 400, "invalid_request_error", "stream"),
    ({**OK, "messages": []}, 400, "invalid_request_error", "messages"),
    ({**OK, "temperature": 1.5}, 400, "invalid_request_error", "temperature"),
    ({**OK, "max_tokens": 0}, 400, "invalid_request_error", "max_tokens"),
    ({**OK, "model": "claude-opus-4"}, 404, "not_found_error", "does not exist"),
    ({**OK, "messages": [{"role": "user", "content": "x" * 5000}]}, 400, "invalid_request_error", "context length"),
    ({**OK, "max_tokens": 5000}, 400, "invalid_request_error", "context length"),
    ({**OK, "stop_sequences": [""]}, 400, "invalid_request_error", "stop"),
    ({**OK, "messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "base64"}}]}]},
     400, "invalid_request_error", "image"),
    ({**OK, "messages": [{"role": "assistant", "content": [{"type": "redacted_thinking", "data": "x"}]}]},
     400, "invalid_request_error", "redacted_thinking"),
    ({**OK, "messages": [*TEXT, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "get_weather", "input": {}}]}], "tools": [WEATHER]},
     400, "invalid_request_error", "tool_result"),
    ({**OK, "messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "nope"}]}]},
     400, "invalid_request_error", "tool"),
    ({**OK, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400, "invalid_request_error", "web_search"),
    ({**OK, "tools": [{**WEATHER, "input_schema": {"type": "string"}}]}, 400, "invalid_request_error", "object"),
    ({**OK, "tools": [{**WEATHER, "name": "bad name"}]}, 400, "invalid_request_error", "pattern"),
    ({**OK, "tool_choice": {"type": "any"}}, 400, "invalid_request_error", "tool"),
    ({**OK, "tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, 400, "invalid_request_error", "nope"),
    ({**OK, "thinking": {"type": "enabled", "budget_tokens": 512}}, 400, "invalid_request_error", "budget_tokens"),
    ({**OK, "max_tokens": 1024, "thinking": {"type": "enabled", "budget_tokens": 1024}}, 400,
     "invalid_request_error", "less than max_tokens"),
    ({**OK, "max_tokens": 1100, "thinking": {"type": "enabled", "budget_tokens": 1024},
      "output_config": {"effort": "medium"}}, 400, "invalid_request_error", "thinking_effort"),
    ({**OK, "mcp_servers": [{"type": "url", "url": "http://x", "name": "x"}]}, 400, "invalid_request_error", "mcp"),
    (b'{"model": "k3-tiny", ', 400, "invalid_request_error", "Invalid JSON"),
    (b'{"model": "k3-tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "\xff\xfe"}]}', 400,
     "invalid_request_error", "parsing the body"),
    (b'{"model": "k3-tiny", "max_tokens": 4, "temperature": NaN, "messages": [{"role": "user", "content": "hi"}]}',
     400, "invalid_request_error", "temperature"),
    (b'{"model": "k3-tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "\\ud800"}]}', 400,
     "invalid_request_error", "surrogates not allowed"),
    # the API edge's limits (hyserve/entrypoints/openai/limits.py), as on the chat path
    (b'{"model": "k3-tiny", "max_tokens": 4, "system": "\\udfff", "messages": [{"role": "user", "content": "hi"}]}',
     400, "invalid_request_error", "system is not valid Unicode"),
    (b'{"model": "k3-tiny", "max_tokens": 4, "stop_sequences": ["\\ud800x"], "messages": [{"role": "user", '
     b'"content": "hi"}]}', 400, "invalid_request_error", "stop_sequences[0] is not valid Unicode"),
    ({**OK, "tools": [{**WEATHER, "input_schema": api.nested_schema(150)}]}, 400, "invalid_request_error",
     "tools nests deeper than 64 levels"),
    ({**OK, "output_config": {"format": {"type": "json_schema", "schema": api.nested_schema(150)}}}, 400,
     "invalid_request_error", "output_config nests deeper than 64"),
    ({**OK, "messages": [*TEXT, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "get_weather", "input": api.nested_schema(150)}]}]}, 400,
     "invalid_request_error", "messages nests deeper than 64"),
    (b'{"model": "k3-tiny", "max_tokens": 4, "messages": ' + b'[' * 100_000 + b']' * 100_000 + b'}', 400,
     "invalid_request_error", "parsing the body"),
    ({**OK, "container": "c"}, 400, "invalid_request_error", "container"),
]


@pytest.mark.parametrize(("body", "status", "kind", "needle"), BAD_REQUESTS, ids=[str(i) for i in range(len(BAD_REQUESTS))])
def test_bad_requests_answer_in_anthropic_shape_and_the_server_keeps_serving(server, client, body, status, kind,
                                                                             needle):
    r = api.post(server, "/v1/messages", body, AUTH)
    assert r.status_code == status, r.text
    payload = r.json()
    assert payload["type"] == "error" and payload["error"]["type"] == kind, payload
    assert needle.lower() in payload["error"]["message"].lower(), payload
    assert client.messages.create(model=MODEL, max_tokens=1, messages=TEXT).stop_reason


@pytest.mark.parametrize(("body", "needle"), [
    ({"model": MODEL, "messages": "hi"}, "messages"),
    (b'{"model": "k3-tiny", "system": "\\udfff", "messages": [{"role": "user", "content": "hi"}]}',
     "system is not valid Unicode"),
    ({"model": MODEL, "messages": TEXT, "tools": [{**WEATHER, "input_schema": api.nested_schema(150)}]},
     "tools nests deeper than 64 levels"),
])
def test_count_tokens_refuses_bad_input_in_anthropic_shape(server, body, needle):
    r = api.post(server, "/v1/messages/count_tokens", body, AUTH)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
    assert needle in r.json()["error"]["message"]


def test_unknown_paths_and_methods_under_v1_messages_answer_in_anthropic_shape(server):
    r = httpx.get(f"{server}/v1/messages", headers=AUTH)
    assert r.status_code == 405 and r.json()["type"] == "error" and "POST" in r.headers["allow"]
    r = httpx.post(f"{server}/v1/messages/batches", headers=AUTH, json={})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
