"""Hostile and malformed requests against a live server: each gets a 4xx with an OpenAI-style error body
naming the problem, and the engine keeps serving afterwards (no 500, no dead engine, no hang).

One k3-tiny server with a short context (512 tokens) runs for the whole module.
"""

from __future__ import annotations

import json
import select
import socket

import httpx
import pytest

from tests.server_util import live_server, wait_idle

CHAT = "/v1/chat/completions"
CMPL = "/v1/completions"
MSGS = [{"role": "user", "content": "hi"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


def nested(depth: int) -> dict:
    """A JSON schema of `depth` nested objects (2 * depth JSON levels)."""
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def deep_tool(depth: int) -> dict:
    return {"type": "function", "function": {"name": "f", "parameters": nested(depth)}}


@pytest.fixture(scope="module")
def server():
    with live_server("--max-model-len", "512", "--max-waiting-requests", "8") as url:
        yield url


def _still_serving(server: str) -> None:
    assert httpx.get(f"{server}/health").status_code == 200, "the engine died"
    r = httpx.post(server + CMPL, json={"prompt": "ok", "max_tokens": 1}, timeout=30)
    assert r.status_code == 200, r.text


BAD_REQUESTS = [
    # (path, body (dict, or raw bytes sent as JSON), status, substring of the error message)
    # n is bounded (vLLM's VLLM_MAX_N_SEQUENCES): 10**9 completions used to exhaust the engine's memory
    (CMPL, {"prompt": "hi", "n": 10**9, "max_tokens": 1}, 400, "n must be"),
    # non-finite sampling values used to turn the logits into NaN and silently return token 0
    (CMPL, b'{"prompt": "hi", "temperature": NaN, "max_tokens": 2}', 400, "temperature"),
    (CMPL, b'{"prompt": "hi", "temperature": Infinity, "max_tokens": 2}', 400, "temperature"),
    (CMPL, b'{"prompt": "hi", "repetition_penalty": Infinity, "max_tokens": 2}', 400, "repetition_penalty"),
    (CMPL, b'{"prompt": "hi", "logit_bias": {"5": NaN}, "max_tokens": 2}', 400, "logit_bias"),
    # seeds are int64 (vLLM's range); larger ones used to fail with torch's "Overflow when unpacking long long"
    (CMPL, {"prompt": "hi", "seed": 2**64 + 5, "max_tokens": 2}, 400, "seed must be"),
    # a stop id past the vocabulary, masked by min_tokens, used to kill the engine process
    (CMPL, {"prompt": "hi", "stop_token_ids": [10**9], "min_tokens": 1, "max_tokens": 3}, 400, "stop_token_ids"),
    (CMPL, {"prompt": "hi", "stop_token_ids": [2**70], "max_tokens": 3}, 400, "stop_token_ids"),
    # malformed chat input used to raise AttributeError (500)
    (CHAT, {"messages": [{"role": "user", "content": ["hi"]}], "max_tokens": 2}, 400, "content parts"),
    (CHAT, {"messages": [*MSGS, {"role": "assistant", "tool_calls": "x"}], "max_tokens": 2}, 400, "messages"),
    (CHAT, {"messages": MSGS, "tools": [WEATHER], "tool_choice": {"type": "function", "function": "get_weather"}},
     400, "tool_choice"),
    ("/tokenize", {"messages": [{"role": "user", "content": [5]}]}, 400, "content parts"),
    # a JSON-escaped lone surrogate cannot be tokenized: used to be a 500 UnicodeEncodeError
    (CMPL, b'{"prompt": "\\ud800", "max_tokens": 1}', 400, "not valid Unicode"),
    # no vision tower: an image would otherwise reach the model as a bare placeholder token
    (CHAT, {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}], "max_tokens": 2},
     400, "image"),
    # body-parsing errors used FastAPI's {"detail": ...} shape
    (CMPL, b'{"prompt": "\xff\xfe"}', 400, "parsing the body"),
    # strings that reach the engine untokenized: a lone surrogate in the cache salt killed the engine loop
    (CMPL, b'{"prompt": "hi", "max_tokens": 4, "cache_salt": "\\udfff"}', 400, "cache_salt is not valid Unicode"),
    (CMPL, b'{"prompt": "hi", "max_tokens": 4, "stop": ["\\ud800"]}', 400, "stop[0] is not valid Unicode"),
    (CMPL, b'{"prompt": "hi", "max_tokens": 4, "structured_outputs": {"regex": "a\\udc00"}}', 400, "not valid Unicode"),
    (CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", '
           b'"function": {"name": "\\udfff"}}]}', 400, "tools[0].function.name is not valid Unicode"),
    (CMPL, b'{"prompt": "hi", "max_tokens": 4, "\\udfff": 1}', 400, "not valid Unicode"),
    # deep nesting: 260 levels hung the request (RecursionError pickling it for the engine), 300 in a
    # tool's parameters answered 500 (RecursionError rendering the chat prompt)
    (CMPL, {"prompt": "hi", "max_tokens": 2, "structured_outputs": {"json": nested(260)}}, 400, "the limit is 64"),
    (CMPL, {"prompt": "hi", "max_tokens": 2, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": nested(260)}}}, 400, "response_format nests deeper than 64 levels"),
    (CHAT, {"messages": MSGS, "max_tokens": 2, "tools": [deep_tool(300)]}, 400, "tools nests deeper than 64"),
    ("/tokenize", {"messages": MSGS, "tools": [deep_tool(300)]}, 400, "the limit is 64"),
    (CMPL, {"prompt": "hi", "max_tokens": 2, "structured_outputs": {"json": json.dumps(nested(260))}}, 400,
     "the limit is 64"),
    (CMPL, {"prompt": "hi", "max_tokens": 2, "structured_outputs": {"json": "[" * 100_000}}, 400, "not valid JSON"),
    (CHAT, {"messages": MSGS, "max_tokens": 2, "tools": [
        {"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object", "properties": {
            f"p{j}": {"type": "string"} for j in range(600)}}}} for i in range(100)]}, 400, "more than 100000"),
    # wrong JSON types were coerced (pydantic's lax mode): now refused, as OpenAI's API does
    (CMPL, {"prompt": "hi", "max_tokens": 4, "stream": "yes"}, 400, "stream must be a valid boolean"),
    (CMPL, {"prompt": "hi", "max_tokens": "8"}, 400, "max_tokens must be a valid integer"),
    (CMPL, {"prompt": "hi", "max_tokens": 4, "n": True}, 400, "n must be a valid integer"),
    (CMPL, {"prompt": "hi", "max_tokens": 4, "temperature": "0.5"}, 400, "temperature must be a valid number"),
    ("/detokenize", {"tokens": [False]}, 400, "tokens[0] must be a valid integer"),
    (CMPL, {"prompt": [1, True], "max_tokens": 4}, 400, "prompt"),
]


@pytest.mark.parametrize(("path", "body", "status", "needle"), BAD_REQUESTS, ids=[f"{i}" for i in range(len(BAD_REQUESTS))])
def test_bad_request_answers_with_status_and_message(server, path, body, status, needle):
    if isinstance(body, bytes):
        r = httpx.post(server + path, content=body, headers={"content-type": "application/json"}, timeout=30)
    else:
        r = httpx.post(server + path, json=body, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle.lower() in err["message"].lower(), err
    assert err["code"] == status and err["type"]
    _still_serving(server)


def test_wrong_method_and_unknown_path_use_the_openai_error_shape(server):
    r = httpx.get(server + CMPL)
    assert r.status_code == 405 and r.json()["error"]["code"] == 405 and "POST" in r.headers["allow"]
    r = httpx.get(f"{server}/v1/nope")
    assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"


def test_extreme_but_valid_values_are_served(server):
    """Values that mean something (a bias past OpenAI's ±100, top_k past the vocabulary, the largest
    int64 seed with n > 1) are served as their clamped meaning, not as an engine error."""
    r = httpx.post(server + CMPL, json={"prompt": "hi", "logit_bias": {"5": 1e308}, "max_tokens": 3}, timeout=30)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "\x05" * 3, r.text
    r = httpx.post(server + CMPL, json={"prompt": "hi", "top_k": 2**70, "max_tokens": 2}, timeout=30)
    assert r.status_code == 200, r.text
    r = httpx.post(server + CMPL, json={"prompt": "hi", "seed": 2**63 - 1, "n": 2, "max_tokens": 2}, timeout=30)
    assert r.status_code == 200 and len(r.json()["choices"]) == 2, r.text
    _still_serving(server)


def test_requests_that_fail_on_the_way_to_the_engine_never_lock_out_the_server(server):
    """Eight schemas too deep to hand to the engine used to hang their handlers and count as waiting
    forever: with --max-waiting-requests 8 every later request answered 503. Now each fails at once."""
    body = {"prompt": "hi", "max_tokens": 2, "structured_outputs": {"json": nested(260)}}
    for _ in range(10):
        r = httpx.post(server + CMPL, json=body, timeout=10)
        assert r.status_code == 400, r.text
    _still_serving(server)


def _raw_post(server: str, headers: str, body_chunks, read: bool = True) -> bytes:
    """POST over a bare socket, so the test can claim a length or stream chunks; returns the response."""
    host, port = server.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(f"POST {CMPL} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n{headers}\r\n".encode())
        for chunk in body_chunks:
            if select.select([sock], [], [], 0)[0]:
                break  # the server has answered: sending on would only get the connection reset
            sock.sendall(chunk)
        return _read_response(sock) if read else b""  # read=False: hang up at once


def _read_response(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
        head, sep, body = data.partition(b"\r\n\r\n")
        lengths = [int(x.split(b":")[1]) for x in head.split(b"\r\n") if x.lower().startswith(b"content-length:")]
        if sep and lengths and len(body) >= lengths[0]:
            break
    return data


def test_a_body_over_the_size_limit_answers_413(server):
    from hyserve.entrypoints.openai.limits import MAX_BODY_BYTES

    answer = _raw_post(server, f"Content-Length: {MAX_BODY_BYTES + 1}\r\n", [])
    assert answer.startswith(b"HTTP/1.1 413") and b"RequestTooLargeError" in answer, answer[:300]
    mib = b" " * (1 << 20)
    chunks = (b"%x\r\n%s\r\n" % (len(mib), mib) for _ in range(MAX_BODY_BYTES // len(mib) + 2))
    answer = _raw_post(server, "Transfer-Encoding: chunked\r\n", chunks)  # no length: counted as it arrives
    assert answer.startswith(b"HTTP/1.1 413"), answer[:300]
    _still_serving(server)


def test_streaming_n_sends_each_choice_finish_reason_once(server):
    """With n > 1 a finished choice's finish_reason used to repeat in every later chunk (29 times here)."""
    body = {"n": 4, "max_tokens": 64, "stop": ["e", "a", "o"], "stream": True, "seed": 3, "temperature": 1.0}
    for path, extra in ((CMPL, {"prompt": "hello"}), (CHAT, {"messages": MSGS})):
        finishes: dict[int, int] = {}
        with httpx.stream("POST", server + path, json={**body, **extra}, timeout=60) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    for c in json.loads(line[6:])["choices"]:
                        if c["finish_reason"] is not None:
                            finishes[c["index"]] = finishes.get(c["index"], 0) + 1
        assert finishes == {0: 1, 1: 1, 2: 1, 3: 1}, (path, finishes)


def test_schemas_of_realistic_depth_are_served(server):
    """The limits sit far above real schemas: 20 nested objects (40 JSON levels) still work."""
    body = {"prompt": "hi", "max_tokens": 3, "structured_outputs": {"json": nested(20)}}
    r = httpx.post(server + CMPL, json=body, timeout=60)
    assert r.status_code == 200, r.text
    r = httpx.post(f"{server}/tokenize", json={"messages": MSGS, "tools": [deep_tool(20)]}, timeout=60)
    assert r.status_code == 200 and r.json()["count"] > 1000, r.text


def test_pool_gauges_return_to_idle_after_aborts_and_disconnects(server):
    """/metrics shows the pools (free KV blocks, running state slots, checkpoint slots): after streams
    dropped mid-way, an n > 1 stream dropped, a non-streaming request abandoned and a request whose client
    hung up at once, every pool is back to its idle value (only prefix-cache checkpoints hold anything)."""
    assert wait_idle(server) == []
    long = {"prompt": "x" * 50, "max_tokens": 440, "ignore_eos": True}
    for extra in ({"stream": True}, {"stream": True, "n": 3}):
        with httpx.stream("POST", server + CMPL, json={**long, **extra}, timeout=60) as r:
            lines = r.iter_lines()
            for _ in range(3):
                next(lines)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server + CMPL, json=long, timeout=httpx.Timeout(60, read=0.5))
    body = json.dumps(long).encode()
    _raw_post(server, f"Content-Length: {len(body)}\r\nConnection: close\r\n", [body], read=False)
    assert wait_idle(server) == []
    _still_serving(server)
