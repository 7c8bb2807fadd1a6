"""Shared pieces of the Responses / Anthropic Messages API tests: the pool check run after every test, SSE
reading, and the tools the tests offer."""

from __future__ import annotations

import json
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.server_util import live_server

# Servers of these tests reserve few checkpoint slots, so that what may stay pinned at idle (one tail page
# per prefix-cache checkpoint) is small next to what a leaked request would hold.
CHECKPOINT_SLOTS = 4


def api_server(*flags: str, **kwargs):
    """`live_server` with the checkpoint slots the pool check expects."""
    return live_server("--num-checkpoint-slots", str(CHECKPOINT_SLOTS), *flags, **kwargs)


WEATHER_PARAMETERS = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"]}
LOOKUP_DESCRIPTION = "Look up a Python standard library function or class."
LOOKUP_PARAMETERS = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
JSON_DUMPS_DOC = ("json.dumps(obj, *, skipkeys=False, ensure_ascii=True, indent=None)\n\n"
                  "Serialize ``obj`` to a JSON formatted ``str``.")


def nested_schema(depth: int) -> dict:
    """A JSON schema of `depth` nested objects (2 * depth JSON levels): past the edge's limit of 64."""
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def _samples(url: str) -> dict[str, tuple[float, dict]]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {s.name: (s.value, s.labels) for fam in text_string_to_metric_families(text) for s in fam.samples}


def assert_pool_idle(url: str, timeout: float = 20.0) -> None:
    """No request runs or waits, and no page is held but the checkpoints' tails (the pool is empty)."""
    deadline = time.monotonic() + timeout
    while True:
        m = _samples(url)
        running, waiting = m["vllm:num_requests_running"][0], m["vllm:num_requests_waiting"][0]
        blocks = int(m["vllm:cache_config_info"][1]["num_blocks"])
        used = round(m["vllm:kv_cache_usage_perc"][0] * blocks)
        if running == 0 and waiting == 0 and used <= CHECKPOINT_SLOTS:
            return
        assert time.monotonic() < deadline, f"pool not idle: {running} running, {waiting} waiting, {used} pages held"
        time.sleep(0.1)


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
    """Read a few events of a long stream, then go away."""
    with httpx.stream("POST", url + path, json=body, headers=headers or {}, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        for _ in range(events):
            next(lines)
        running = _samples(url)["vllm:num_requests_running"][0]
        assert running == 1, "the request was not running while it streamed"
