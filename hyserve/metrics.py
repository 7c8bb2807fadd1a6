"""Prometheus metrics with vLLM's names, labels and buckets (docs/ARCHITECTURE.md §8.4), so dashboards carry over.

Each server app owns a private `CollectorRegistry`. Latency histograms are observed in the server
process as deltas arrive; engine-side counts (tokens, prefix cache, preemptions) and gauges are read from
the engine's newest stats snapshot at scrape time, so they are exact rather than re-accumulated.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0)
FINISHED_REASONS = ("stop", "length", "abort")
# The cache pools, free and total, so a leak shows on /metrics (vLLM has no such gauges). On an idle server
# every running state slot is free, every KV block is free but those prefix-cache checkpoints pin, and
# every checkpoint slot is free but those the checkpoints hold.
POOL_GAUGES = (
    ("hyserve:kv_blocks_free", "kv_blocks_free", "KV cache blocks (pages) on the free list, cached ones included."),
    ("hyserve:kv_blocks_capacity", "kv_blocks_capacity", "KV cache blocks (pages) in the pool."),
    ("hyserve:kv_blocks_pinned", "kv_blocks_pinned", "KV cache blocks held by prefix-cache checkpoints."),
    ("hyserve:state_slots_free", "state_slots_free", "Free KDA state slots for running requests."),
    ("hyserve:state_slots_capacity", "state_slots_capacity", "KDA state slots for running requests."),
    ("hyserve:checkpoint_slots_free", "checkpoint_slots_free", "Free KDA state slots for prefix-cache checkpoints."),
    ("hyserve:checkpoint_slots_capacity", "checkpoint_slots_capacity", "KDA state slots for prefix-cache checkpoints."),
    ("hyserve:prefix_cache_checkpoints", "prefix_cache_checkpoints", "Checkpoints the prefix cache holds (a slot each)."),
)


class _EngineStatsCollector(Collector):
    """Gauges and counters straight from the engine's cumulative stats snapshot."""

    def __init__(self, stats: Callable[[], dict[str, Any]], labels: dict[str, str]) -> None:
        self._stats = stats
        self._labels = labels

    def collect(self) -> Iterator:
        s = self._stats() or {}
        names, values = list(self._labels), list(self._labels.values())

        def gauge(name: str, doc: str, value: float):
            g = GaugeMetricFamily(name, doc, labels=names)
            g.add_metric(values, float(value))
            return g

        def counter(name: str, doc: str, value: float):
            c = CounterMetricFamily(name, doc, labels=names)
            c.add_metric(values, float(value))
            return c

        yield gauge("vllm:num_requests_running", "Requests in the running batch.", s.get("num_running", 0))
        yield gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.", s.get("num_waiting", 0))
        yield gauge("vllm:kv_cache_usage_perc", "Fraction of KV cache pages in use (0-1).", s.get("kv_cache_usage", 0))
        yield counter("vllm:prompt_tokens", "Prompt tokens processed.", s.get("prompt_tokens", 0))
        cached, external = s.get("prompt_tokens_cached", 0), s.get("prompt_tokens_external", 0)
        yield counter("vllm:prompt_tokens_cached", "Prompt tokens not recomputed (prefix cache hits).", cached)
        by_source = CounterMetricFamily("vllm:prompt_tokens_by_source", "Prompt tokens by where they came from.",
                                        labels=names + ["source"])
        for source, value in (("local_compute", s.get("prompt_tokens", 0) - cached),
                              ("local_cache_hit", cached - external), ("external_kv_transfer", external)):
            by_source.add_metric(values + [source], float(value))
        yield by_source
        yield counter("vllm:generation_tokens", "Tokens generated.", s.get("generation_tokens", 0))
        yield counter("vllm:prefix_cache_queries", "Prefix cache queries, in tokens.", s.get("prefix_cache_queries", 0))
        yield counter("vllm:prefix_cache_hits", "Prefix cache hits, in tokens.", s.get("prefix_cache_hits", 0))
        yield counter("vllm:num_preemptions", "Requests preempted.", s.get("num_preemptions", 0))
        yield counter("hyserve:kernels_compiled_after_ready", "Triton kernel variants compiled after the engine "
                      "was ready (each one a wait the warm-up did not cover).", s.get("kernels_compiled_after_ready", 0))
        yield from _step_counters(s.get("steps") or {}, names, values)
        for name, key, doc in POOL_GAUGES:
            if key in s:
                yield gauge(name, doc, s[key])
        if s.get("spec_decode") is not None:
            yield from _spec_decode_counters(s["spec_decode"], names, values)


STEP_COUNTERS = (
    ("hyserve:engine_steps", "steps", "Engine steps, by how they ran (graph: decode graphs; eager: the forward)."),
    ("hyserve:engine_step_tokens", "tokens", "Tokens computed by engine steps, by how they ran."),
    ("hyserve:engine_step_seconds", "seconds", "Wall time engine steps held the engine, from launch (or the "
     "landing before) to landing, by how they ran (engine/step_times.py)."),
)


def _step_counters(steps: dict[str, Any], names: list[str], values: list[str]) -> Iterator:
    for name, key, doc in STEP_COUNTERS:
        c = CounterMetricFamily(name, doc, labels=names + ["kind"])
        for kind, value in sorted((steps.get(key) or {}).items()):
            c.add_metric(values + [kind], float(value))
        yield c


def _spec_decode_counters(spec: dict[str, Any], names: list[str], values: list[str]) -> Iterator:
    """vLLM's speculative-decoding counters (an engine with `speculative_config` only)."""
    for name, key, doc in (
        ("vllm:spec_decode_num_drafts", "num_drafts", "Verify steps of a request that carried drafts."),
        ("vllm:spec_decode_num_draft_tokens", "num_draft_tokens", "Draft tokens verified."),
        ("vllm:spec_decode_num_accepted_tokens", "num_accepted_tokens", "Draft tokens accepted."),
    ):
        c = CounterMetricFamily(name, doc, labels=names)
        c.add_metric(values, float(spec.get(key, 0)))
        yield c
    per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by "
                                  "position in the draft.", labels=names + ["position"])
    for pos, n in enumerate(spec.get("accepted_per_position", ())):
        per_pos.add_metric(values + [str(pos)], float(n))
    yield per_pos


class ServerMetrics:
    """The observer `AsyncEngineClient` calls; also renders /metrics."""

    def __init__(self, model_name: str, stats: Callable[[], dict[str, Any]], engine: str = "0") -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        labels = {"model_name": model_name, "engine": engine}
        self._labels = labels
        names = list(labels)
        r = self.registry
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token.", names,
                              buckets=TTFT_BUCKETS, registry=r).labels(**labels)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Inter-token latency.", names,
                             buckets=ITL_BUCKETS, registry=r).labels(**labels)
        self.tpot = Histogram("vllm:request_time_per_output_token_seconds", "Per-request time per output token.",
                              names, buckets=ITL_BUCKETS, registry=r).labels(**labels)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency.", names,
                             buckets=LATENCY_BUCKETS, registry=r).labels(**labels)
        success = Counter("vllm:request_success", "Finished requests by finish reason.",
                          names + ["finished_reason"], registry=r)
        self.success = {reason: success.labels(**labels, finished_reason=reason) for reason in FINISHED_REASONS}
        r.register(_EngineStatsCollector(stats, labels))

    # ---- observer hooks -------------------------------------------------------------------------------
    def on_tokens(self, stream: Any, n: int, now: float) -> None:
        if stream.first_token_time is None:
            self.ttft.observe(now - stream.arrival_time)
        elif stream.last_token_time is not None:
            self.itl.observe(now - stream.last_token_time)

    def on_finish(self, stream: Any, reason: str, now: float) -> None:
        reason = reason if reason in self.success else "stop"
        self.success[reason].inc()
        self.e2e.observe(now - stream.arrival_time)
        steps = stream.num_generated
        if stream.first_token_time is not None and stream.last_token_time is not None and steps > 1:
            self.tpot.observe((stream.last_token_time - stream.first_token_time) / (steps - 1))

    def set_cache_config(self, info: dict[str, Any]) -> None:
        """`vllm:cache_config_info` (=1): the engine's cache configuration, as labels."""
        keys = ("block_size", "num_blocks", "num_state_slots", "max_num_seqs", "device")
        cfg = {k: str(info.get(k, "")) for k in keys}
        g = Gauge("vllm:cache_config_info", "Cache configuration (value 1; the labels carry it).",
                  list(self._labels) + list(keys), registry=self.registry)
        g.labels(**self._labels, **cfg).set(1)

    def render(self) -> bytes:
        return generate_latest(self.registry)


__all__ = ["POOL_GAUGES", "ServerMetrics", "TTFT_BUCKETS", "ITL_BUCKETS", "LATENCY_BUCKETS"]
