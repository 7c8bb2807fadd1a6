"""The OpenAI-compatible server, specified through the official `openai` client against a live server.

One k3-tiny server (random weights, byte tokenizer) runs for the whole module; a second, strict one
(API key, one running sequence, a waiting-queue cap of 1) checks authentication and overload.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

from tests.server_util import live_server, metric, metrics

MODEL = "k3-tiny"
NO_THINK = {"chat_template_kwargs": {"thinking": False}}


@pytest.fixture(scope="module")
def server():
    with live_server("--max-num-seqs", "64") as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def aclient_factory(server):
    return lambda: openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)


# ---- basic endpoints --------------------------------------------------------------------------------------


def test_models_health_version_and_request_id_echo(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(f"{server}/health").status_code == 200
    assert "version" in httpx.get(f"{server}/version").json()
    r = httpx.post(f"{server}/v1/completions", json={"prompt": "hi", "max_tokens": 1}, headers={"X-Request-Id": "r-42"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "r-42"


def test_tokenize_and_detokenize_round_trip(server):
    toks = httpx.post(f"{server}/tokenize", json={"prompt": "héllo"}).json()
    assert toks["count"] == len("héllo".encode()) and toks["max_model_len"] == 4096
    assert httpx.post(f"{server}/detokenize", json={"tokens": toks["tokens"]}).json() == {"prompt": "héllo"}
    chat = httpx.post(f"{server}/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] > 5


# ---- completions -------------------------------------------------------------------------------------------


def test_completion_n_logprobs_echo_and_usage(client):
    r = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=6, n=2, logprobs=3, echo=True,
                                  seed=7, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1]
    for c in r.choices:
        assert c.text.startswith("The sky is") and c.finish_reason == "length"
        # echo: the block covers the prompt tokens (the first without a logprob), then the 6 generated
        n = len(b"The sky is") + 6
        assert len(c.logprobs.tokens) == n and len(c.logprobs.token_logprobs) == n
        assert c.logprobs.top_logprobs[0] is None and all(len(top) <= 3 for top in c.logprobs.top_logprobs[1:])
    assert r.usage.prompt_tokens == len(b"The sky is") and r.usage.completion_tokens == 12
    assert r.usage.prompt_tokens_details.cached_tokens >= 0


def test_completion_prompt_forms_token_ids_and_lists(client):
    r = client.completions.create(model=MODEL, prompt=[[72, 105], [104, 101, 121]], max_tokens=2,
                                  extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1] and r.usage.prompt_tokens == 5
    r = client.completions.create(model=MODEL, prompt=["a", "b", "c"], max_tokens=1)
    assert len(r.choices) == 3


def test_completion_streaming_with_usage(client):
    chunks = list(client.completions.create(model=MODEL, prompt="Once", max_tokens=10, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    finals = [c.choices[0].finish_reason for c in chunks[:-1] if c.choices[0].finish_reason]
    assert finals == ["length"]
    assert all(c.usage is None for c in chunks[:-1])


def test_stop_string_cuts_the_text(client):
    base = client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=24, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = next((base[i:i + 2] for i in range(4, len(base) - 2) if "\ufffd" not in base[i:i + 2]), None)
    assert stop is not None, base
    cut = base[: base.index(stop)]
    r = client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=24, temperature=0, stop=[stop],
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == cut and r.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=[1, 2, 3], max_tokens=24, temperature=0, stop=[stop], stream=True,
        extra_body={"ignore_eos": True}))
    assert streamed == cut


# ---- chat --------------------------------------------------------------------------------------------------


def test_chat_thinking_on_streams_reasoning_not_content(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                                       extra_body={"ignore_eos": True})
    msg = r.choices[0].message
    assert msg.role == "assistant" and msg.model_extra.get("reasoning") and msg.content is None
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 8


def test_chat_streaming_first_delta_has_role_and_last_has_finish(client):
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True, **NO_THINK}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 8 and chunks[-1].choices == []


def test_chat_stop_string_is_cut_from_streamed_and_whole_answers(client):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "count"}], max_tokens=30, temperature=0,
              extra_body={"ignore_eos": True, **NO_THINK})
    base = client.chat.completions.create(**kw).choices[0].message.content or ""
    stop = next((base[i:i + 2] for i in range(3, len(base) - 2) if "\ufffd" not in base[i:i + 2]), None)
    if stop is None:
        pytest.skip(f"greedy output too short to pick a stop string: {base!r}")
    r = client.chat.completions.create(stop=[stop], **kw).choices[0]
    assert r.finish_reason == "stop" and r.message.content == base[: base.index(stop)]
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        stop=[stop], stream=True, **kw) if c.choices)
    assert streamed == base[: base.index(stop)]


def test_chat_n_and_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                       n=3, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    for c in r.choices:
        assert len(c.logprobs.content) == 4
        assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in c.logprobs.content)


SCHEMA = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "green", "blue"]}, "count": {"type": "integer"},
                   "ok": {"type": "boolean"}},
    "required": ["color", "count", "ok"],
    "additionalProperties": False,
}


def _valid(obj) -> bool:
    return (isinstance(obj, dict) and set(obj) == {"color", "count", "ok"} and obj["color"] in ("red", "green", "blue")
            and isinstance(obj["count"], int) and not isinstance(obj["count"], bool) and isinstance(obj["ok"], bool))


def test_json_schema_output_always_parses_and_validates(aclient_factory):
    """Random weights, yet every one of 20 answers is valid: the grammar leaves no other choice."""

    async def one(ac, i):
        r = await ac.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"give me JSON #{i}"}], max_tokens=400, seed=i,
            response_format={"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}},
            extra_body=NO_THINK)
        return r.choices[0]

    async def main():
        ac = aclient_factory()
        return await asyncio.gather(*(one(ac, i) for i in range(20)))

    for choice in asyncio.run(main()):
        assert choice.finish_reason == "stop", choice
        assert _valid(json.loads(choice.message.content)), choice.message.content


def test_structured_outputs_choice_and_regex(client):
    r = client.completions.create(model=MODEL, prompt="pick", max_tokens=20,
                                  extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert r.choices[0].text in ("yes", "no")
    r = client.completions.create(model=MODEL, prompt="code", max_tokens=20,
                                  extra_body={"structured_outputs": {"regex": "[A-Z]{3}-[0-9]{2}"}})
    assert len(r.choices[0].text) == 6 and r.choices[0].text[3] == "-"


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer"}},
    "required": ["city", "days"]}}}


def test_tool_choice_required_returns_a_tool_call(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "weather?"}],
                                       tools=[WEATHER], tool_choice="required", max_tokens=1000,
                                       parallel_tool_calls=False, extra_body=NO_THINK)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    args = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and args["city"].strip() in ("Paris", "Oslo")


def test_named_tool_choice_streams_one_whole_call(client):
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "weather?"}], tools=[WEATHER], max_tokens=1000,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, parallel_tool_calls=False,
        stream=True, extra_body=NO_THINK))
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert len(calls) == 1 and calls[0].index == 0 and calls[0].function.name == "get_weather"
    assert json.loads(calls[0].function.arguments)["days"] is not None
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_thirty_two_concurrent_streams(aclient_factory):
    async def one(ac, i):
        text, finish = "", None
        stream = await ac.completions.create(model=MODEL, prompt=f"client {i}", max_tokens=8, stream=True,
                                             extra_body={"ignore_eos": True})
        async for chunk in stream:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        return finish

    async def main():
        ac = aclient_factory()
        return await asyncio.gather(*(one(ac, i) for i in range(32)))

    assert asyncio.run(main()) == ["length"] * 32


def test_disconnect_mid_stream_aborts_and_frees_the_cache(server):
    """The request holds ~32 pages while it streams; once the client goes, at most the prefix cache's
    checkpoint tails (a page or two) stay pinned, on top of what earlier checkpoints pinned."""
    before = metric(server, "vllm:kv_cache_usage_perc")
    body = {"prompt": "x" * 2000, "max_tokens": 2000, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        for _ in range(3):
            next(lines)
        assert metric(server, "vllm:num_requests_running") == 1
        held = metric(server, "vllm:kv_cache_usage_perc") - before
        assert held > 0
    deadline = time.monotonic() + 10
    while metric(server, "vllm:num_requests_running") or metric(server, "vllm:kv_cache_usage_perc") > before + held / 8:
        assert time.monotonic() < deadline, "the aborted request still holds the engine"
        time.sleep(0.1)
    assert metric(server, "vllm:request_success_total", finished_reason="abort") >= 1


def test_disconnect_while_waiting_for_a_non_streaming_answer_aborts_it(server):
    body = {"prompt": "y" * 100, "max_tokens": 3000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server}/v1/completions", json=body, timeout=httpx.Timeout(60, read=1.5))
    deadline = time.monotonic() + 10
    while metric(server, "vllm:num_requests_running"):
        assert time.monotonic() < deadline, "the abandoned request is still running"
        time.sleep(0.1)


# ---- errors ------------------------------------------------------------------------------------------------

CHAT = "/v1/chat/completions"
CMPL = "/v1/completions"
MSGS = [{"role": "user", "content": "hi"}]
BAD_REQUESTS = [
    # (path, body (dict or raw text), status, substring of the error message)
    (CMPL, "{not json", 400, "Invalid JSON"),
    (CMPL, {"max_tokens": 4}, 400, "prompt"),
    (CMPL, {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    (CMPL, {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    (CMPL, {"prompt": "hi", "n": 0}, 400, "n must be"),
    (CMPL, {"prompt": "hi", "presence_penalty": 3}, 400, "presence_penalty"),
    (CMPL, {"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    (CMPL, {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    (CMPL, {"prompt": "hi", "max_tokens": 5000}, 400, "maximum context length"),
    (CMPL, {"prompt": "x" * 5000}, 400, "maximum context length"),
    (CMPL, {"prompt": [1, 2, 100000]}, 400, "out of range"),
    (CMPL, {"prompt": "hi", "stop": [""]}, 400, "stop"),
    (CMPL, {"prompt": "hi", "model": "gpt-9"}, 404, "does not exist"),
    (CMPL, {"prompt": "hi", "min_tokens": 9, "max_tokens": 4}, 400, "min_tokens"),
    (CMPL, {"prompt": "hi", "structured_outputs": {"regex": "("}}, 400, "regex"),
    (CHAT, {"messages": []}, 400, "messages"),
    (CHAT, {"messages": MSGS, "tool_choice": "required"}, 400, "tool_choice"),
    (CHAT, {"messages": MSGS, "tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     400, "nope"),
    (CHAT, {"messages": MSGS, "reasoning_effort": "medium"}, 400, "thinking_effort"),
    (CHAT, {"messages": MSGS, "top_logprobs": 2}, 400, "top_logprobs"),
    (CHAT, {"messages": MSGS, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, 400, "schema"),
    (CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "role"),
    (CHAT, {"messages": MSGS, "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    ("/detokenize", {"tokens": [999999]}, 400, "out of range"),
]


@pytest.mark.parametrize(("path", "body", "status", "needle"), BAD_REQUESTS, ids=[f"{i}" for i in range(len(BAD_REQUESTS))])
def test_bad_request_answers_with_status_and_message(server, path, body, status, needle):
    if isinstance(body, str):
        r = httpx.post(server + path, content=body, headers={"content-type": "application/json"})
    else:
        r = httpx.post(server + path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle.lower() in err["message"].lower(), err
    assert err["code"] == status and err["type"]
    # ...and the server keeps serving
    assert httpx.post(server + CMPL, json={"prompt": "ok", "max_tokens": 1}).status_code == 200


def test_metrics_count_what_was_sent(server, client):
    before_ok = metric(server, "vllm:request_success_total")
    before_gen = metric(server, "vllm:generation_tokens_total")
    before_ttft = metric(server, "vllm:time_to_first_token_seconds_count")
    for _ in range(3):
        client.completions.create(model=MODEL, prompt="m", max_tokens=5, extra_body={"ignore_eos": True})
    m = metrics(server)
    labels = {"model_name": MODEL, "engine": "0"}
    assert all(any(n == name and set(labels.items()) <= set(ls) for (n, ls) in m) for name in (
        "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
        "vllm:prompt_tokens_total", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
        "vllm:num_preemptions_total", "vllm:inter_token_latency_seconds_bucket",
        "vllm:request_time_per_output_token_seconds_count", "vllm:e2e_request_latency_seconds_sum",
        "vllm:cache_config_info", "hyserve:kernels_compiled_after_ready_total"))
    assert metric(server, "vllm:request_success_total") - before_ok == 3
    assert metric(server, "vllm:generation_tokens_total") - before_gen == 15
    assert metric(server, "vllm:time_to_first_token_seconds_count") - before_ttft == 3


def test_prompt_tokens_by_source_sum_to_prompt_tokens(server, client):
    prompt = "a shared prefix that the second request reuses " * 4
    for _ in range(2):
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    total = metric(server, "vllm:prompt_tokens_total")
    assert metric(server, "vllm:prompt_tokens_by_source_total") == total > 0
    assert metric(server, "vllm:prompt_tokens_by_source_total", source="local_cache_hit") == metric(
        server, "vllm:prompt_tokens_cached_total") > 0


# ---- authentication and overload ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def strict_server():
    with live_server("--api-key", "sekrit", "--max-num-seqs", "1", "--max-waiting-requests", "1") as url:
        yield url


def test_api_key_is_required(strict_server):
    body = {"prompt": "hi", "max_tokens": 1}
    assert httpx.post(f"{strict_server}/v1/completions", json=body).status_code == 401
    bad = httpx.post(f"{strict_server}/v1/completions", json=body, headers={"Authorization": "Bearer nope"})
    assert bad.status_code == 401 and "API key" in bad.json()["error"]["message"]
    ok = openai.OpenAI(base_url=f"{strict_server}/v1", api_key="sekrit", max_retries=0)
    assert ok.completions.create(model=MODEL, prompt="hi", max_tokens=1).choices
    assert httpx.get(f"{strict_server}/health").status_code == 200


def test_overload_answers_503_with_retry_after(strict_server):
    async def main():
        headers = {"Authorization": "Bearer sekrit"}
        body = {"prompt": "hi", "max_tokens": 60, "ignore_eos": True}
        async with httpx.AsyncClient(base_url=strict_server, headers=headers, timeout=120) as hc:
            return await asyncio.gather(*(hc.post("/v1/completions", json=body) for _ in range(8)))

    responses = asyncio.run(main())
    codes = sorted(r.status_code for r in responses)
    assert 200 in codes and 503 in codes, codes
    rejected = next(r for r in responses if r.status_code == 503)
    assert rejected.headers["retry-after"] and "overloaded" in rejected.json()["error"]["message"]
