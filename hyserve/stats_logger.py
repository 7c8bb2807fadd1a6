"""The periodic stats line of a busy server, as vLLM's frontend prints it (its LoggingStatLogger):

    Avg prompt throughput: 812.4 tokens/s, Avg generation throughput: 96.0 tokens/s, Running: 4 reqs,
    Waiting: 0 reqs, GPU KV cache usage: 12.5%, Prefix cache hit rate: 66.0%, Preemptions: 0

Fed by the engine's stats snapshots (cumulative counters and gauges, one per engine step, see
`engine_core._EngineLoop._stats`); `log()` runs every `interval` seconds and reports the counters' change
since the previous line. The line after the last busy interval shows the zeros; after that an idle server
is silent. Prompt throughput counts every prompt token once per request, cached or computed (vLLM's
meaning); the hit rate is over the prefix-cache queries of the interval, in tokens. With speculative
decoding the line adds the interval's mean acceptance length and acceptance rates (vLLM's SpecDecoding
line, folded into this one).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("hyserve.stats")

_COUNTERS = ("prompt_tokens", "generation_tokens", "prefix_cache_queries", "prefix_cache_hits", "num_preemptions")


class LoggingStatLogger:
    def __init__(self, interval: float = 10.0, clock: Callable[[], float] = time.monotonic,
                 emit: Callable[[str], None] = log.info) -> None:
        self.interval, self.clock, self.emit = interval, clock, emit
        self.latest: dict[str, Any] = {}
        self.last_counts: dict[str, float] = {}
        self.last_time = clock()
        self.was_busy = False
        self.last_spec: tuple[dict[str, float], list[float]] = ({}, [])

    def record(self, stats: dict[str, Any]) -> None:
        """The engine's newest snapshot (called for every step message)."""
        self.latest = stats

    def log(self) -> str | None:
        """The line for the interval since the previous call, emitted and returned; None when idle."""
        now = self.clock()
        s = self.latest
        counts = {k: float(s.get(k, 0)) for k in _COUNTERS}
        delta = {k: max(0.0, counts[k] - self.last_counts.get(k, 0.0)) for k in _COUNTERS}
        dt = max(now - self.last_time, 1e-9)
        self.last_counts, self.last_time = counts, now
        running, waiting = int(s.get("num_running", 0)), int(s.get("num_waiting", 0))
        busy = bool(running or waiting or delta["prompt_tokens"] or delta["generation_tokens"])
        if not busy and not self.was_busy:
            return None
        self.was_busy = busy
        queries = delta["prefix_cache_queries"]
        hit_rate = delta["prefix_cache_hits"] / queries if queries else 0.0
        line = (f"Avg prompt throughput: {delta['prompt_tokens'] / dt:.1f} tokens/s, "
                f"Avg generation throughput: {delta['generation_tokens'] / dt:.1f} tokens/s, "
                f"Running: {running} reqs, Waiting: {waiting} reqs, "
                f"GPU KV cache usage: {100 * float(s.get('kv_cache_usage', 0.0)):.1f}%, "
                f"Prefix cache hit rate: {100 * hit_rate:.1f}%, "
                f"Preemptions: {int(delta['num_preemptions'])}")
        line += self._spec_line(s.get("spec_decode"))
        self.emit(line)
        return line

    def _spec_line(self, spec: dict[str, Any] | None) -> str:
        """Speculative decoding over the interval: vLLM's mean acceptance length (1 + accepted / drafts, the
        bonus token included), the draft acceptance rate and the acceptance rate at each draft position."""
        if spec is None:
            return ""
        now = {k: float(spec.get(k, 0)) for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
        pos = [float(n) for n in spec.get("accepted_per_position", ())]
        last, last_pos = self.last_spec
        d = {k: v - last.get(k, 0.0) for k, v in now.items()}
        d_pos = [n - (last_pos[i] if i < len(last_pos) else 0.0) for i, n in enumerate(pos)]
        self.last_spec = (now, pos)
        drafts = max(d["num_drafts"], 1.0)
        rate = d["num_accepted_tokens"] / d["num_draft_tokens"] if d["num_draft_tokens"] else 0.0
        per_pos = ", ".join(f"{n / drafts:.3f}" for n in d_pos)
        return (f", Mean acceptance length: {1 + d['num_accepted_tokens'] / drafts:.2f}, "
                f"Draft acceptance rate: {100 * rate:.1f}%, Per-position acceptance rate: [{per_pos}]")

    async def run(self) -> None:
        """Log every `interval` seconds until cancelled (a task on the server's event loop)."""
        while True:
            await asyncio.sleep(self.interval)
            self.log()
