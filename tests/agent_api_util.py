"""Shared pieces of the Responses / Anthropic Messages API tests: the pool check run after every test, SSE
reading, and the tools the tests offer."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.server_util import live_server, metric, wait_idle

# Servers of these tests reserve few checkpoint slots: the prefix cache evicts its checkpoints (and the
# tail pages they pin) early, so the tests also run with a cache under pressure.
CHECKPOINT_SLOTS = 4


def api_server(*flags: str, **kwargs):
    """`live_server` with few checkpoint slots."""
    return live_server("--num-checkpoint-slots", str(CHECKPOINT_SLOTS), *flags, **kwargs)


WEATHER_PARAMETERS = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"]}
LOOKUP_DESCRIPTION = "Look up a Python standard library function or class."
LOOKUP_PARAMETERS = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
JSON_DUMPS_DOC = ("json.dumps(obj, *, skipkeys=False, ensure_ascii=True, indent=None)\n\n"
                  "Serialize ``obj`` to a JSON formatted ``str``.")


# An answer that cannot end early (random weights might stop at once): a JSON string of 2000 characters.
LONG_FORMAT = {"type": "json_schema", "schema": {"type": "string", "minLength": 2000}}


def nested_schema(depth: int) -> dict:
    """A JSON schema of `depth` nested objects (2 * depth JSON levels): past the edge's limit of 64."""
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def assert_pool_idle(url: str, timeout: float = 20.0) -> None:
    """No request runs or waits, and every pool gauge (free KV blocks, running state slots, checkpoint
    slots) is at its idle value: nothing is held but what the prefix cache retains (the pool is empty)."""
    assert wait_idle(url, timeout) == []


def sse_events(url: str, path: str, body: dict, headers: dict | None = None) -> list[tuple[str, dict]]:
    """(event name, data) of every event of a streamed answer."""
    events, name = [], None
    with httpx.stream("POST", url + path, json=body, headers=headers or {}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                events.append((name, json.loads(line[6:])))
    return events


def post(url: str, path: str, body: dict | bytes, headers: dict | None = None) -> httpx.Response:
    if isinstance(body, bytes):
        headers = {"content-type": "application/json", **(headers or {})}
        return httpx.post(url + path, content=body, headers=headers, timeout=60)
    return httpx.post(url + path, json=body, headers=headers or {}, timeout=60)


def stream_then_disconnect(url: str, path: str, body: dict, headers: dict | None = None, events: int = 4) -> None:
    """Read a few events of a long stream, then go away: the engine aborts the request (one more abort
    counted) and every pool gauge returns to idle."""
    aborts = metric(url, "vllm:request_success_total", finished_reason="abort")
    with httpx.stream("POST", url + path, json=body, headers=headers or {}, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        for _ in range(events):
            next(lines)
        assert metric(url, "vllm:num_requests_running") == 1, "the request was not running while it streamed"
    assert wait_idle(url) == []
    assert metric(url, "vllm:request_success_total", finished_reason="abort") == aborts + 1


def abandon_while_it_runs(url: str, path: str, body: dict, headers: dict | None = None) -> None:
    """POST a long non-streaming request and hang up while it runs: the engine aborts it (one more abort
    counted) and every pool gauge (free KV blocks, running state slots, checkpoint slots) returns to idle."""
    aborts = metric(url, "vllm:request_success_total", finished_reason="abort")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + path, json=body, headers=headers or {}, timeout=httpx.Timeout(60, read=1.5))
    assert wait_idle(url) == []
    assert metric(url, "vllm:request_success_total", finished_reason="abort") == aborts + 1
