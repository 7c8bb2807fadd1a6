"""Scrape the few Prometheus counters the benchmarks need (docs/ARCHITECTURE.md §8.4 names)."""

from __future__ import annotations

import math
import re

import httpx

PREFIX_QUERIES = "vllm:prefix_cache_queries"
PREFIX_HITS = "vllm:prefix_cache_hits"
# name, optional {labels} (greedy: label values may hold braces), value; comments never match.
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?\s+(\S+)")


_KIND = re.compile(r'kind="([^"]*)"')


def parse_counters(text: str) -> dict[str, float]:
    """Sum every sample of each metric over its label sets; `_total` suffixes are folded away.

    Summing over labels is what we want: the engine exports one series per engine-core index. A series
    with a `kind` label is also summed under `name[kind]` (the engine's step counters by kind).
    """
    sums: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line.strip())
        if not m:
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        if not math.isfinite(value):
            continue
        name = m.group(1)
        if name.endswith("_total"):
            name = name[: -len("_total")]
        sums[name] = sums.get(name, 0.0) + value
        if m.group(2) and (k := _KIND.search(m.group(2))):
            sums[f"{name}[{k.group(1)}]"] = sums.get(f"{name}[{k.group(1)}]", 0.0) + value
    return sums


def step_mix(before: dict[str, float] | None, after: dict[str, float] | None, window_s: float) -> dict | None:
    """Per step kind over a window: steps per second, ms per step, tokens per step and the share of the
    window the kind's steps held the engine (from `hyserve:engine_step*`); None without those counters."""
    if not before or not after or window_s <= 0:
        return None
    out = {}
    for kind in sorted({k[len("hyserve:engine_steps["):-1] for k in after if k.startswith("hyserve:engine_steps[")}):
        d = {x: after.get(f"hyserve:engine_{x}[{kind}]", 0.0) - before.get(f"hyserve:engine_{x}[{kind}]", 0.0)
             for x in ("steps", "step_tokens", "step_seconds")}
        if d["steps"] > 0:
            out[kind] = {"steps_per_s": d["steps"] / window_s, "ms_per_step": 1e3 * d["step_seconds"] / d["steps"],
                         "tokens_per_step": d["step_tokens"] / d["steps"], "busy_share": d["step_seconds"] / window_s}
    return out or None


async def scrape(client: httpx.AsyncClient, base_url: str, timeout: float = 10.0) -> dict[str, float] | None:
    """GET /metrics; None when the server has no metrics endpoint or it fails (never raises)."""
    try:
        resp = await client.get(base_url.rstrip("/") + "/metrics", timeout=timeout)
        if resp.status_code != 200:
            return None
        return parse_counters(resp.text)
    except (httpx.HTTPError, OSError):
        return None


def prefix_hit_rate_delta(before: dict[str, float] | None, after: dict[str, float] | None) -> float | None:
    """Hit rate over a window = Δhits / Δqueries (both in tokens), None if unavailable."""
    if not before or not after or PREFIX_QUERIES not in after:
        return None
    dq = after.get(PREFIX_QUERIES, 0.0) - before.get(PREFIX_QUERIES, 0.0)
    dh = after.get(PREFIX_HITS, 0.0) - before.get(PREFIX_HITS, 0.0)
    return dh / dq if dq > 0 else None
