"""Hostile and malformed requests against a live server: each gets a 4xx with an OpenAI-style error body
naming the problem, and the engine keeps serving afterwards (no 500, no dead engine, no hang).

One k3-tiny server with a short context (512 tokens) runs for the whole module.
"""

from __future__ import annotations

import httpx
import pytest

from tests.server_util import live_server

CHAT = "/v1/chat/completions"
CMPL = "/v1/completions"
MSGS = [{"role": "user", "content": "hi"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


@pytest.fixture(scope="module")
def server():
    with live_server("--max-model-len", "512") as url:
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
