"""Streaming OpenAI-compatible load client (`hyserve bench serve`) and the shared request sender.

`send_request` never raises: transport failures, HTTP errors and mid-stream `{"error": ...}` events
all come back as a failed `RequestResult` carrying the server's message, so one bad request cannot
take down a long benchmark.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import httpx
import numpy as np
from tqdm.asyncio import tqdm

from hyserve.bench.datasets import SampleRequest, ids_to_text
from hyserve.bench.metrics import DEFAULT_PERCENTILES, RequestResult, compute_serve_metrics

ENDPOINT_PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


@dataclass
class EndpointConfig:
    base_url: str
    model: str
    endpoint: str = "completions"
    stream: bool = True
    ignore_eos: bool = True
    # "ids" sends token ids (exact lengths; completions only); "text" renders them as characters.
    prompt_format: str = "ids"
    request_timeout_s: float = 600.0
    extra_body: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINT_PATHS:
            raise ValueError(f"endpoint must be one of {sorted(ENDPOINT_PATHS)}, got {self.endpoint!r}")
        if self.endpoint == "chat" and self.prompt_format == "ids":
            # Chat messages are text by definition; fall back rather than send an invalid body.
            self.prompt_format = "text"

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + ENDPOINT_PATHS[self.endpoint]


def build_payload(
    cfg: EndpointConfig, prompt_ids: list[int], output_len: int, extra: dict | None = None
) -> dict:
    body: dict = {"model": cfg.model, "stream": cfg.stream, "ignore_eos": cfg.ignore_eos, "temperature": 0.0}
    prompt = prompt_ids if cfg.prompt_format == "ids" else ids_to_text(prompt_ids)
    if cfg.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
        body["max_completion_tokens"] = output_len
    else:
        body["prompt"] = prompt
        body["max_tokens"] = output_len
    if cfg.stream:
        body["stream_options"] = {"include_usage": True}
    body.update(cfg.extra_body)
    body.update(extra or {})
    return body


def _error_message(status: int, raw: bytes) -> str:
    try:
        err = json.loads(raw).get("error")
        msg = err.get("message") if isinstance(err, dict) else err
    except (ValueError, AttributeError):
        msg = None
    text = msg if msg else raw.decode("utf-8", "replace").strip()[:500]
    return f"HTTP {status}: {text}"


def _chunk_text(chunk: dict) -> str:
    """Generated text in one chunk/response: completion text, chat content, reasoning or tool args."""
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    c = choices[0]
    if "text" in c:
        return c.get("text") or ""
    msg = c.get("delta") or c.get("message") or {}
    parts = [msg.get("content"), msg.get("reasoning"), msg.get("reasoning_content")]
    for call in msg.get("tool_calls") or []:
        fn = call.get("function") or {}
        parts += [fn.get("name"), fn.get("arguments")]
    return "".join(p for p in parts if isinstance(p, str))


def _is_token_chunk(chunk: dict) -> bool:
    """Whether a stream chunk carries generated tokens.

    A completions chunk may carry tokens whose text is still "" (a byte-level tokenizer holds back a
    partial UTF-8 character), so any choice counts there except a finish-only one with no text. Chat
    chunks count when they carry text: the role-only first delta and finish-only last delta do not.
    """
    choices = chunk.get("choices") or []
    if not choices:
        return False
    c = choices[0]
    if "text" in c:
        return bool(c.get("text")) or c.get("finish_reason") is None
    return bool(_chunk_text(chunk))


def _apply_usage(result: RequestResult, usage: dict | None) -> bool:
    if not usage:
        return False
    if usage.get("completion_tokens") is not None:
        result.output_len = int(usage["completion_tokens"])
    if usage.get("prompt_tokens") is not None:
        result.prompt_len = int(usage["prompt_tokens"])
    details = usage.get("prompt_tokens_details") or {}
    if details.get("cached_tokens") is not None:
        result.cached_tokens = int(details["cached_tokens"])
    return usage.get("completion_tokens") is not None


async def send_request(
    client: httpx.AsyncClient,
    cfg: EndpointConfig,
    prompt_ids: list[int],
    output_len: int,
    extra_body: dict | None = None,
) -> RequestResult:
    """Send one request and time it; every failure is folded into the result."""
    result = RequestResult(prompt_len=len(prompt_ids), streamed=cfg.stream)
    body = build_payload(cfg, prompt_ids, output_len, extra_body)
    st = time.perf_counter()
    result.start_time = st
    try:
        async with client.stream("POST", cfg.url, json=body, timeout=cfg.request_timeout_s) as resp:
            result.status_code = resp.status_code
            if resp.status_code != 200:
                result.error = _error_message(resp.status_code, await resp.aread())
                return result
            if cfg.stream and "text/event-stream" in resp.headers.get("content-type", "text/event-stream"):
                await _consume_stream(resp, result, st)
            else:
                data = json.loads(await resp.aread())
                if "error" in data:
                    raise _StreamError(data["error"])
                result.ttft = result.latency = time.perf_counter() - st
                result.streamed = False
                if not _apply_usage(result, data.get("usage")):
                    result.output_len = output_len
                result.success = True
    except _StreamError as e:
        result.error = f"stream error: {e.message}"
    except (httpx.HTTPError, OSError, ValueError) as e:
        result.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    if not result.success and result.latency == 0.0:
        result.latency = time.perf_counter() - st
    return result


class _StreamError(Exception):
    def __init__(self, err) -> None:
        self.message = err.get("message", str(err)) if isinstance(err, dict) else str(err)
        super().__init__(self.message)


async def _consume_stream(resp: httpx.Response, result: RequestResult, st: float) -> None:
    n_chunks = 0
    last = st
    have_usage = False
    async for line in resp.aiter_lines():
        line = line.strip()
        if not line.startswith("data:"):
            continue  # SSE comments / keep-alives / blank separators
        payload = line[len("data:") :].strip()
        if payload == "[DONE]":
            break
        chunk = json.loads(payload)
        if "error" in chunk:
            raise _StreamError(chunk["error"])
        now = time.perf_counter()
        if _is_token_chunk(chunk):
            if n_chunks == 0:
                result.ttft = now - st
            else:
                result.itl.append(now - last)
            last = now
            n_chunks += 1
        have_usage = _apply_usage(result, chunk.get("usage")) or have_usage
    result.latency = time.perf_counter() - st
    if n_chunks == 0:
        result.error = "stream ended without any generated tokens"
        return
    if not have_usage:
        # Without usage each content chunk is taken as one token (true for plain decoding).
        result.output_len = n_chunks
    result.success = True


# --------------------------------------------------------------------------- load generation


def arrival_gaps(n: int, request_rate: float, burstiness: float, seed: int) -> list[float]:
    """Inter-arrival gaps: gamma(shape=burstiness) with mean 1/rate; burstiness 1 = Poisson."""
    if math.isinf(request_rate) or request_rate <= 0:
        return [0.0] * n
    rng = np.random.default_rng(seed)
    theta = 1.0 / (request_rate * burstiness)
    return rng.gamma(shape=burstiness, scale=theta, size=n).tolist()


async def _paced(requests: Sequence[SampleRequest], gaps: Sequence[float]) -> AsyncIterator[SampleRequest]:
    for req, gap in zip(requests, gaps):
        yield req
        if gap > 0:
            await asyncio.sleep(gap)


@dataclass
class ServeBenchConfig:
    endpoint: EndpointConfig
    requests: list[SampleRequest]
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    num_warmups: int = 0
    seed: int = 0
    percentiles: tuple[float, ...] = DEFAULT_PERCENTILES
    goodput_slos: dict[str, float] = field(default_factory=dict)
    disable_tqdm: bool = False


def _client(max_conn: int) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=max_conn, max_keepalive_connections=max_conn)
    # No pool timeout: under `--request-rate inf` requests legitimately queue for a connection.
    return httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(600.0, connect=30.0, pool=None))


async def run_serve_benchmark(cfg: ServeBenchConfig) -> tuple[dict, list[RequestResult]]:
    """Run warm-ups, then the paced benchmark; return (metrics, per-request results)."""
    n = len(cfg.requests)
    max_conn = max(1, min(cfg.max_concurrency or n, 4096))
    sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None

    async def one(client: httpx.AsyncClient, req: SampleRequest) -> RequestResult:
        if sem is None:
            return await send_request(client, cfg.endpoint, req.prompt_ids, req.output_len)
        async with sem:
            return await send_request(client, cfg.endpoint, req.prompt_ids, req.output_len)

    async with _client(max_conn) as client:
        warm = [cfg.requests[i % n] for i in range(cfg.num_warmups)] if n else []
        warm_results = await asyncio.gather(*(one(client, r) for r in warm))
        gaps = arrival_gaps(n, cfg.request_rate, cfg.burstiness, cfg.seed)
        pbar = tqdm(total=n, disable=cfg.disable_tqdm, desc="bench serve")
        tasks: list[asyncio.Task] = []

        async def tracked(req: SampleRequest) -> RequestResult:
            r = await one(client, req)
            pbar.update(1)
            return r

        start = time.perf_counter()
        async for req in _paced(cfg.requests, gaps):
            tasks.append(asyncio.create_task(tracked(req)))
        results = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - start
        pbar.close()

    metrics = compute_serve_metrics(results, duration, cfg.percentiles, cfg.goodput_slos)
    metrics["warmup_requests"] = len(warm)
    metrics["warmup_failed"] = sum(1 for r in warm_results if not r.success)
    return metrics, results


def format_serve_table(m: dict, percentiles: Sequence[float] = DEFAULT_PERCENTILES) -> str:
    rows: list[tuple[str, object]] = [
        ("Successful requests", m["completed"]),
        ("Failed requests", m["failed"]),
        ("Benchmark duration (s)", m["duration_s"]),
        ("Total input tokens", m["total_input_tokens"]),
        ("Total generated tokens", m["total_output_tokens"]),
        ("Request throughput (req/s)", m["request_throughput"]),
        ("Output token throughput (tok/s)", m["output_throughput"]),
        ("Total token throughput (tok/s)", m["total_token_throughput"]),
    ]
    if "request_goodput" in m:
        rows.append(("Request goodput (req/s)", m["request_goodput"]))
    for name, label in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2EL")):
        rows.append((f"-- {label} (ms)", None))
        rows.append(("  mean", m[f"mean_{name}_ms"]))
        for q in percentiles:
            key = f"p{q:g}".replace(".", "_")
            rows.append((f"  p{q:g}", m[f"{key}_{name}_ms"]))
    lines = ["=" * 20 + " hyserve bench serve " + "=" * 20]
    for label, value in rows:
        if value is None:
            lines.append(label)
        elif isinstance(value, float):
            lines.append(f"{label:<40}{value:>16.2f}")
        else:
            lines.append(f"{label:<40}{value!s:>16}")
    errs = m.get("errors", {})
    if errs.get("count"):
        lines.append(f"-- Errors ({errs['count']})")
        lines += [f"  {e['count']:>5} x {e['message']}" for e in errs["messages"]]
    lines.append("=" * 61)
    return "\n".join(lines)
