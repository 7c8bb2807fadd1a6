"""A soak: many mixed requests against one live server, each kind checked for the answer it must get.

The mix is what a hostile or careless population of clients sends: full streams, streams dropped at a
random point, requests whose client hangs up at once, non-streaming requests abandoned mid-way, n > 1
(streamed and not), structured outputs, prompts over the context length, and bad requests (wrong JSON
types, invalid Unicode, nesting over the limits). `run_soak` returns per-kind counts and every answer
that broke its kind's rule; tests/test_soak.py (CI size) and benchmarks/soak.py (10,000 requests) then
check that the server went back to idle (pool gauges), still answers a fixed greedy request exactly as
before, and kept its memory bounded.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import httpx

from hyserve.bench.prometheus import parse_counters

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
MSGS = [{"role": "user", "content": "hi"}]
CHOICES = ["red", "green", "blue"]
# A fixed greedy request: its answer must not change however the server was treated in between.
PROBE = {"prompt": "The soak probe:", "max_tokens": 12, "temperature": 0.0, "ignore_eos": True}


def _nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


BAD = [
    (CMPL, {"prompt": "hi", "max_tokens": "8"}),
    (CMPL, {"prompt": "hi", "stream": "yes"}),
    (CMPL, {"prompt": "hi", "n": True}),
    (CMPL, {"prompt": "hi", "temperature": -1}),
    (CMPL, {"prompt": "hi", "structured_outputs": {"json": _nested(100)}}),
    (CHAT, {"messages": MSGS, "tools": [{"type": "function", "function": {"name": "f", "parameters": _nested(100)}}]}),
    (CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}),
    ("/detokenize", {"tokens": [False]}),
]
BAD_RAW = [b'{"prompt": "hi", "max_tokens": 4, "cache_salt": "\\udfff"}', b'{"prompt": "hi", "stop": ["\\ud800"]}']


@dataclass
class SoakResult:
    counts: Counter = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)

    def expect(self, ok: bool, kind: str, detail: str) -> None:
        if not ok:
            self.problems.append(f"{kind}: {detail[:300]}")


def _events(lines: list[str]) -> list:
    return [json.loads(x[6:]) for x in lines if x.startswith("data: {")]


def _finish_once(events: list, n: int) -> bool:
    finishes = Counter(c["index"] for e in events for c in e.get("choices", []) if c.get("finish_reason"))
    return finishes == Counter(range(n))


class _Kinds:
    """One coroutine per request kind; each records what it got in `result`."""

    def __init__(self, client: httpx.AsyncClient, result: SoakResult, rng: random.Random, max_model_len: int) -> None:
        self.client, self.result, self.rng, self.max_model_len = client, result, rng, max_model_len

    def body(self, **extra) -> dict:
        return {"prompt": f"soak {self.rng.randrange(10**6)}", "max_tokens": self.rng.randint(2, 24),
                "temperature": 1.0, "ignore_eos": True, **extra}

    async def stream(self, path: str, body: dict, stop_after: int | None = None) -> tuple[int, list[str]]:
        lines = []
        async with self.client.stream("POST", path, json=body) as r:
            async for line in r.aiter_lines():
                if line:
                    lines.append(line)
                if stop_after is not None and len(lines) >= stop_after:
                    break
        return r.status_code, lines

    async def full_stream(self) -> None:
        n = self.rng.choice([1, 1, 2, 3])
        status, lines = await self.stream(CMPL, self.body(stream=True, n=n))
        self.result.expect(status == 200 and lines[-1:] == ["data: [DONE]"] and _finish_once(_events(lines), n),
                           "full_stream", f"{status} {lines[-2:]}")

    async def chat_stream(self) -> None:
        n = self.rng.choice([1, 2])
        body = {"messages": MSGS, "max_tokens": self.rng.randint(2, 16), "n": n, "stream": True, "ignore_eos": True}
        status, lines = await self.stream(CHAT, body)
        self.result.expect(status == 200 and _finish_once(_events(lines), n), "chat_stream", f"{status} {lines[-2:]}")

    async def dropped_stream(self) -> None:
        body = self.body(stream=True, max_tokens=self.rng.randint(50, 200), n=self.rng.choice([1, 2]))
        status, _ = await self.stream(CMPL, body, stop_after=self.rng.randint(1, 6))
        self.result.expect(status == 200, "dropped_stream", str(status))

    async def hang_up(self) -> None:
        """The client sends a request and closes the connection without reading a byte."""
        host, port = str(self.client.base_url).removeprefix("http://").rstrip("/").split(":")
        data = json.dumps(self.body(max_tokens=100, stream=self.rng.random() < 0.5)).encode()
        _, writer = await asyncio.open_connection(host, int(port))
        writer.write(f"POST {CMPL} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
        await writer.drain()
        writer.close()
        await writer.wait_closed()

    async def abandoned(self) -> None:
        """A non-streaming request whose client gives up while it runs."""
        try:
            await self.client.post(CMPL, json=self.body(max_tokens=200), timeout=httpx.Timeout(30, read=0.2))
        except httpx.ReadTimeout:
            pass

    async def n_many(self) -> None:
        n = self.rng.randint(2, 4)
        r = await self.client.post(CMPL, json=self.body(n=n))
        choices = r.json().get("choices", []) if r.status_code == 200 else []
        self.result.expect(len(choices) == n and all(c["finish_reason"] == "length" for c in choices),
                           "n_many", r.text)

    async def structured(self) -> None:
        r = await self.client.post(CMPL, json={"prompt": "pick:", "max_tokens": 8, "structured_outputs": {"choice": CHOICES}})
        c = r.json()["choices"][0] if r.status_code == 200 else {}
        self.result.expect(c.get("finish_reason") != "stop" or c.get("text") in CHOICES, "structured", r.text)

    async def too_long(self) -> None:
        r = await self.client.post(CMPL, json={"prompt": [5] * (self.max_model_len + self.rng.randint(0, 50))})
        self.result.expect(r.status_code == 400 and "context length" in r.text, "too_long", r.text)

    async def bad(self) -> None:
        if self.rng.random() < 0.25:
            path, r = CMPL, await self.client.post(CMPL, content=self.rng.choice(BAD_RAW),
                                                   headers={"content-type": "application/json"})
        else:
            path, body = self.rng.choice(BAD)
            r = await self.client.post(path, json=body)
        self.result.expect(r.status_code == 400 and "error" in r.json(), "bad", f"{path} {r.status_code} {r.text}")

    def table(self) -> list[tuple[str, Callable[[], Awaitable[None]], int]]:
        return [("full_stream", self.full_stream, 4), ("chat_stream", self.chat_stream, 2),
                ("dropped_stream", self.dropped_stream, 3), ("hang_up", self.hang_up, 2),
                ("abandoned", self.abandoned, 1), ("n_many", self.n_many, 2), ("structured", self.structured, 2),
                ("too_long", self.too_long, 1), ("bad", self.bad, 3)]


async def run_soak(base_url: str, num_requests: int, *, concurrency: int = 8, seed: int = 0,
                   max_model_len: int = 512, progress: Callable[[int], None] | None = None) -> SoakResult:
    """Send `num_requests` mixed requests, `concurrency` at a time."""
    result, rng = SoakResult(), random.Random(seed)
    limits = httpx.Limits(max_connections=concurrency * 2)
    async with httpx.AsyncClient(base_url=base_url, timeout=120, limits=limits) as client:
        kinds = _Kinds(client, result, rng, max_model_len).table()
        names, funcs, weights = zip(*kinds)
        plan = rng.choices(range(len(kinds)), weights=weights, k=num_requests)
        queue: asyncio.Queue[int] = asyncio.Queue()
        for i in plan:
            queue.put_nowait(i)
        done = 0

        async def worker() -> None:
            nonlocal done
            while not queue.empty():
                i = queue.get_nowait()
                try:
                    await funcs[i]()
                except Exception as e:  # a transport failure is a finding too, not the end of the soak
                    result.problems.append(f"{names[i]}: {type(e).__name__}: {e}")
                result.counts[names[i]] += 1
                done += 1
                if progress is not None:
                    progress(done)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return result


def probe(base_url: str) -> str:
    r = httpx.post(f"{base_url}{CMPL}", json=PROBE, timeout=60)
    r.raise_for_status()
    return r.json()["choices"][0]["text"]


def rss_bytes(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def pool_leaks(base_url: str) -> list[str]:
    """What an idle server's pool gauges show held beyond the prefix cache's own retention (empty: none)."""
    m = {k.removeprefix("hyserve:"): v for k, v in parse_counters(httpx.get(f"{base_url}/metrics").text).items()}
    checks = [
        ("running state slots", m["state_slots_capacity"] - m["state_slots_free"]),
        ("KV blocks", m["kv_blocks_capacity"] - m["kv_blocks_free"] - m["kv_blocks_pinned"]),
        ("checkpoint slots", m["checkpoint_slots_capacity"] - m["checkpoint_slots_free"] - m["prefix_cache_checkpoints"]),
    ]
    return [f"{held:g} {name} held" for name, held in checks if held]


def wait_idle(base_url: str, timeout: float = 30.0) -> list[str]:
    """Wait until nothing runs or waits and the pools are back to idle; returns what is still held then."""
    deadline = time.monotonic() + timeout
    while True:
        m = parse_counters(httpx.get(f"{base_url}/metrics").text)
        busy = m.get("vllm:num_requests_running", 0) + m.get("vllm:num_requests_waiting", 0)
        leaks = pool_leaks(base_url)
        if (not busy and not leaks) or time.monotonic() > deadline:
            return leaks + ([f"{busy:g} requests still running or waiting"] if busy else [])
        time.sleep(0.2)
