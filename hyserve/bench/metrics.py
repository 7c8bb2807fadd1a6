"""Benchmark metric computations (docs/ARCHITECTURE.md §9).

Everything here is pure: it takes per-request records with wall-clock timestamps and returns plain
dicts, so the definitions can be tested on hand-made chunk-time streams without a server.

Two families of definitions live side by side on purpose:

* `vllm bench serve`: TPOT per request, ITL = every inter-chunk gap pooled across requests.
* InferenceX / AgentX (agentic replay): ITL per request = (E2EL - TTFT) / (OSL - 1), tok/s/user =
  1/ITL with the percentile taken on ITL (so p90 interactivity is the *slow* tail), tok/s/GPU = total
  tokens over [first start, last end] / GPUs.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

DEFAULT_PERCENTILES: tuple[float, ...] = (50.0, 90.0, 99.0)
GOODPUT_KEYS = ("ttft", "tpot", "e2el")


@dataclass
class RequestResult:
    """One request as the client saw it. Times are seconds on one monotonic clock."""

    success: bool = False
    prompt_len: int = 0
    output_len: int = 0
    start_time: float = 0.0
    ttft: float = 0.0
    latency: float = 0.0
    # Gaps between consecutive non-empty content chunks (the first chunk's arrival is the TTFT).
    itl: list[float] = field(default_factory=list)
    # False for non-streamed responses: then TTFT == latency and TPOT / ITL are undefined.
    streamed: bool = True
    cached_tokens: int | None = None
    error: str = ""
    status_code: int | None = None

    @property
    def end_time(self) -> float:
        return self.start_time + self.latency

    @property
    def tpot(self) -> float | None:
        """(latency - TTFT) / (out - 1); undefined for one-token or non-streamed outputs."""
        if not self.streamed or self.output_len <= 1:
            return None
        return (self.latency - self.ttft) / (self.output_len - 1)


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default, as vLLM uses); NaN for no data."""
    if len(values) == 0:
        return math.nan
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


def _pct_key(q: float) -> str:
    return f"p{q:g}".replace(".", "_")


def distribution(values: Sequence[float], percentiles: Iterable[float] = DEFAULT_PERCENTILES) -> dict:
    """mean / std / pXX of `values`; NaN entries for an empty sample (JSON-safe via `jsonable`)."""
    out = {
        "mean": float(np.mean(values)) if len(values) else math.nan,
        "std": float(np.std(values)) if len(values) else math.nan,
    }
    for q in percentiles:
        out[_pct_key(q)] = percentile(values, q)
    out["count"] = len(values)
    return out


def parse_goodput(items: Sequence[str] | None) -> dict[str, float]:
    """Parse `ttft:MS tpot:MS e2el:MS` SLO items into {metric: milliseconds}."""
    slos: dict[str, float] = {}
    for item in items or ():
        name, sep, value = item.partition(":")
        name = name.strip().lower()
        if not sep or name not in GOODPUT_KEYS:
            raise ValueError(f"bad --goodput item {item!r}: expected one of {GOODPUT_KEYS} as NAME:MS")
        ms = float(value)
        if ms < 0:
            raise ValueError(f"--goodput {name} must be >= 0 ms, got {ms}")
        slos[name] = ms
    return slos


def meets_slos(r: RequestResult, slos: dict[str, float]) -> bool:
    """A request is good only if it meets *every* SLO given (metric <= SLO, in ms)."""
    measured = {
        "ttft": r.ttft * 1000.0,
        # vLLM counts a one-token output's TPOT as 0, so it never fails the TPOT SLO.
        "tpot": (r.tpot or 0.0) * 1000.0,
        "e2el": r.latency * 1000.0,
    }
    return all(measured[k] <= v for k, v in slos.items())


def summarize_errors(results: Iterable[RequestResult], limit: int = 20) -> dict:
    msgs = Counter(r.error or "unknown error" for r in results if not r.success)
    return {
        "count": sum(msgs.values()),
        "messages": [{"message": m, "count": c} for m, c in msgs.most_common(limit)],
    }


def compute_serve_metrics(
    results: Sequence[RequestResult],
    duration_s: float,
    percentiles: Iterable[float] = DEFAULT_PERCENTILES,
    goodput_slos: dict[str, float] | None = None,
) -> dict:
    """`vllm bench serve` definitions over a finished run of `duration_s` seconds."""
    percentiles = tuple(percentiles)
    ok = [r for r in results if r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_len for r in ok)
    dur = max(duration_s, 1e-9)
    out: dict = {
        "duration_s": duration_s,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / dur,
        "output_throughput": total_out / dur,
        "total_token_throughput": (total_in + total_out) / dur,
    }
    samples_ms = {
        "ttft": [r.ttft * 1000.0 for r in ok],
        "tpot": [r.tpot * 1000.0 for r in ok if r.tpot is not None],
        # Pooled: every gap of every request is one sample, so long outputs weigh more.
        "itl": [g * 1000.0 for r in ok for g in r.itl],
        "e2el": [r.latency * 1000.0 for r in ok],
    }
    for name, values in samples_ms.items():
        for stat, v in distribution(values, percentiles).items():
            if stat != "count":
                out[f"{stat}_{name}_ms"] = v
    cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    if cached:
        out["total_cached_tokens"] = sum(cached)
    if goodput_slos:
        good = sum(1 for r in ok if meets_slos(r, goodput_slos))
        out["goodput_slos_ms"] = dict(goodput_slos)
        out["good_requests"] = good
        out["request_goodput"] = good / dur
    out["errors"] = summarize_errors(results)
    return out


def per_request_itl(r: RequestResult) -> float | None:
    """InferenceX/AIPerf ITL of one request: (E2EL - TTFT) / (OSL - 1) seconds."""
    return r.tpot


def compute_agentic_metrics(
    results: Sequence[RequestResult],
    num_gpus: int = 1,
    percentiles: Iterable[float] = DEFAULT_PERCENTILES,
) -> dict:
    """AgentX-style interactivity vs throughput summary over profiled requests."""
    percentiles = tuple(percentiles)
    ok = [r for r in results if r.success]
    itl_ms = [v * 1000.0 for r in ok if (v := per_request_itl(r)) is not None]
    itl = distribution(itl_ms, percentiles)
    # Percentiles are on ITL, then inverted: tok/s/user pXX = 1000 / ITL pXX (pXX is the slow tail).
    per_user = {
        k: (1000.0 / v if v and v > 0 else math.nan) for k, v in itl.items() if k not in ("std", "count")
    }
    # OSL/E2EL ("E2E-normalised interactivity"), inverted the same way: percentile on E2EL per token.
    e2e_per_tok = [r.latency / r.output_len for r in ok if r.output_len > 0]
    e2e_inter = {
        _pct_key(q): (1.0 / p if (p := percentile(e2e_per_tok, q)) > 0 else math.nan) for q in (75.0, 90.0)
    }
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_len for r in ok)
    window = (max(r.end_time for r in ok) - min(r.start_time for r in ok)) if ok else 0.0
    total_tps = (total_in + total_out) / window if window > 0 else 0.0
    out_tps = total_out / window if window > 0 else 0.0
    gpus = max(int(num_gpus), 1)
    return {
        "requests_completed": len(ok),
        "requests_failed": len(results) - len(ok),
        "num_gpus": gpus,
        "window_s": window,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "total_token_throughput": total_tps,
        "output_token_throughput": out_tps,
        "tok_s_per_gpu": total_tps / gpus,
        "output_tok_s_per_gpu": out_tps / gpus,
        "tok_s_per_user": per_user,
        "e2e_interactivity": e2e_inter,
        "itl_ms": itl,
        "ttft_ms": distribution([r.ttft * 1000.0 for r in ok], percentiles),
        "e2el_ms": distribution([r.latency * 1000.0 for r in ok], percentiles),
        "errors": summarize_errors(results),
    }


def jsonable(obj):
    """Replace NaN/inf by None so result files are strict JSON."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    return obj
