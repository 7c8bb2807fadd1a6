"""Agentic trace replayer (`hyserve bench agentic replay`, docs/ARCHITECTURE.md §9).

Lanes: `concurrency` live trajectory trees, each replaying one trace; subagents run inside their
parent's lane (concurrently within a fan-out, gating the next parent turn), so in-flight requests can
exceed the lane count. A drained lane starts the next trace from turn 0.

Prompts are token ids built from the trace's hash ids: each id maps deterministically to a block of
`block_size` filler ids, so two requests share exactly the prefix their hash ids say they share.
A per-tree salt (`cache_salt` and/or salt tokens written at the start of the conversation, after any
file-wide shared system/tool blocks) keeps lanes that replay the same trace from hitting each other;
`salt_nonce` keeps runs with the same seed (a sweep's points against one server) apart the same way.
`warmup_barrier` (off by default, as the spec has it) starts the window only once every lane's warm-up
landed, so a run far shorter than the spec's 900 s measures warm sessions rather than c cold prefills at once.

The observed hit rate is over the requests the theoretical one counts (completed, profiled), from their
usage; the /metrics delta also counts the warm-up requests (misses by construction: nothing of their
tree was sent before), the requests cancelled at the end of the window and preempted re-admissions.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import httpx
import numpy as np
from tqdm import tqdm

from hyserve.bench.datasets import DEFAULT_VOCAB_HIGH, DEFAULT_VOCAB_LOW
from hyserve.bench.metrics import DEFAULT_PERCENTILES, RequestResult, compute_agentic_metrics
from hyserve.bench.prometheus import prefix_hit_rate_delta, scrape, step_mix
from hyserve.bench.serve_client import EndpointConfig, send_request
from hyserve.bench.traces import hit_tokens, theoretical_hit_rate

MIN_VALID_DURATION_S = 900.0
MAX_OVERFLOW_FRACTION = 0.01


class BlockFiller:
    """hash id -> `block_size` token ids in [low, high], deterministic in (scope key, hash id)."""

    def __init__(self, low: int, high: int, block_size: int = 64, cache_blocks: int = 65_536) -> None:
        if high < low:
            raise ValueError("vocab_high must be >= vocab_low")
        self.low, self.high, self.block_size = low, high, block_size
        self._cache: OrderedDict[tuple, np.ndarray] = OrderedDict()
        self._cap = cache_blocks

    def block(self, scope: str, hash_id: object) -> np.ndarray:
        key = (scope, hash_id)
        blk = self._cache.get(key)
        if blk is None:
            # blake2b, not hash(): Python's str hash is salted per process and would break determinism.
            seed = int.from_bytes(
                hashlib.blake2b(f"{scope}\x00{hash_id}".encode(), digest_size=8).digest(), "little"
            )
            blk = np.random.default_rng(seed).integers(
                self.low, self.high + 1, self.block_size, dtype=np.int64
            )
            self._cache[key] = blk
            if len(self._cache) > self._cap:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        return blk

    def prompt(self, scope: str, hash_ids: list, length: int, pad_key: str = "") -> list[int]:
        """Exactly `length` ids: the blocks of `hash_ids`, padded with request-private blocks if the
        record has fewer ids than its length needs (never the case for well-formed traces)."""
        n_blocks = -(-length // self.block_size)
        ids = list(hash_ids[:n_blocks])
        ids += [f"pad:{pad_key}:{i}" for i in range(len(ids), n_blocks)]
        if not ids:
            return []
        return np.concatenate([self.block(scope, h) for h in ids])[:length].tolist()


def salt_ids(salt: str, low: int, high: int) -> list[int]:
    """`[rid:<hex>]` as ids: characters map to themselves when in range (byte-level vocabularies),
    otherwise into [low, high]; the spec's trailing blank line becomes two spaces."""
    span = high - low + 1
    return [ord(c) if low <= ord(c) <= high else low + ord(c) % span for c in f"[rid:{salt}]  "]


@dataclass
class ReplayConfig:
    traces: list[dict]
    endpoint: EndpointConfig
    concurrency: int = 1
    duration_s: float = 1800.0
    time_scale: float = 1.0
    idle_cap_s: float = 10.0
    warmup: bool = True
    vocab_low: int = DEFAULT_VOCAB_LOW
    vocab_high: int = DEFAULT_VOCAB_HIGH
    max_input_len: int | None = None
    max_output_len: int | None = None
    salt_tokens: bool = True
    cache_salt_field: bool = True
    num_gpus: int = 1
    seed: int = 0
    grace_s: float = 0.0
    percentiles: tuple[float, ...] = DEFAULT_PERCENTILES
    disable_tqdm: bool = False
    keep_requests: bool = False
    salt_nonce: str = ""
    # every lane's warm-up lands before the window (and the /metrics "before" scrape) starts: a short run
    # then measures warm sessions, not c cold prefills at once (the spec's 900+ s runs need no barrier)
    warmup_barrier: bool = False


@dataclass
class _Tree:
    """One replay of one trace in one lane."""

    trace: dict
    scope: str
    salt: str
    salt_ids: list[int]
    shared_prefix: int
    seen: set = field(default_factory=set)
    in_flight: int = 0


@dataclass
class _Sent:
    result: RequestResult
    profiled: bool
    theoretical_hit: int
    lane: int


class Replayer:
    def __init__(self, cfg: ReplayConfig) -> None:
        if not cfg.traces:
            raise ValueError("no traces to replay")
        if cfg.concurrency < 1:
            raise ValueError("concurrency must be >= 1")
        self.cfg = cfg
        self.rng = np.random.default_rng(cfg.seed)
        self.order = self.rng.permutation(len(cfg.traces)).tolist()
        self.next_trace = 0
        self.fillers: dict[int, BlockFiller] = {}
        self.sent: list[_Sent] = []
        self.in_flight = 0
        self.stop = asyncio.Event()
        self.warm_left = cfg.concurrency
        self.warm = asyncio.Event()

    # ------------------------------------------------------------------ prompt synthesis
    def _filler(self, block_size: int) -> BlockFiller:
        if block_size not in self.fillers:
            self.fillers[block_size] = BlockFiller(self.cfg.vocab_low, self.cfg.vocab_high, block_size)
        return self.fillers[block_size]

    def _new_tree(self, lane: int) -> _Tree:
        trace = self.cfg.traces[self.order[self.next_trace % len(self.order)]]
        self.next_trace += 1
        salt = self.rng.bytes(6).hex()
        if self.cfg.salt_nonce:
            salt = f"{self.cfg.salt_nonce}-{salt}"
        scope = "global" if trace.get("hash_id_scope") == "global" else f"trace:{trace.get('id', id(trace))}"
        # In global-scope files the system/tool blocks are shared across sessions: salt after them.
        shared = (
            int(trace.get("system_tokens", 0)) + int(trace.get("tool_tokens", 0)) if scope == "global" else 0
        )
        ids = salt_ids(salt, self.cfg.vocab_low, self.cfg.vocab_high) if self.cfg.salt_tokens else []
        return _Tree(trace, scope, salt, ids, shared)

    def build_prompt(self, tree: _Tree, req: dict, subagent: bool, pad_key: str) -> tuple[list[int], int]:
        """(prompt ids, theoretical hit tokens) for one recorded request, truncated to the input cap."""
        bs = int(tree.trace.get("block_size", 64))
        length = int(req["in"])
        if self.cfg.max_input_len:
            # Keep the leading tokens: hash structure (and so prefix sharing) is preserved exactly.
            length = min(length, self.cfg.max_input_len)
        length = max(length, 1)
        ids = self._filler(bs).prompt(tree.scope, req.get("hash_ids", []), length, pad_key)
        if tree.salt_ids:
            # Always at the same position: moved into a shared block, it would make that block differ
            # from the same hash id's block in the tree's other prompts.
            pos = 0 if subagent else tree.shared_prefix
            salt = tree.salt_ids[: max(0, length - pos)]
            ids[pos : pos + len(salt)] = salt
        used = list(req.get("hash_ids", []))[: -(-length // bs)]
        hit = hit_tokens(length, used, tree.seen, bs)
        tree.seen.update(used[: length // bs])
        return ids, hit

    # ------------------------------------------------------------------ lane logic
    async def _think(self, tree: _Tree, seconds: float) -> None:
        # The idle cap applies only when nothing of this tree is in flight (spec: end-to-start gaps).
        if tree.in_flight == 0:
            seconds = min(seconds, self.cfg.idle_cap_s)
        delay = max(0.0, seconds) * self.cfg.time_scale
        if delay > 0:
            try:
                await asyncio.wait_for(self.stop.wait(), timeout=delay)
            except asyncio.TimeoutError:
                pass

    async def _send(
        self,
        client: httpx.AsyncClient,
        tree: _Tree,
        req: dict,
        lane: int,
        subagent: bool,
        profiled: bool,
        pad_key: str,
    ) -> None:
        prompt, hit = self.build_prompt(tree, req, subagent, pad_key)
        out = max(1, int(req.get("out", 1)))
        if self.cfg.max_output_len:
            out = min(out, self.cfg.max_output_len)
        extra = {"cache_salt": tree.salt} if self.cfg.cache_salt_field else None
        tree.in_flight += 1
        self.in_flight += 1
        try:
            result = await send_request(client, self.cfg.endpoint, prompt, out, extra)
        finally:
            tree.in_flight -= 1
            self.in_flight -= 1
        self.sent.append(_Sent(result, profiled, hit, lane))

    async def _agent(
        self, client: httpx.AsyncClient, tree: _Tree, reqs: list[dict], lane: int, subagent: bool, path: str
    ) -> None:
        i = 0
        first = True
        while i < len(reqs) and not self.stop.is_set():
            r = reqs[i]
            if r.get("type") == "subagent":
                j = i
                while j < len(reqs) and reqs[j].get("type") == "subagent":
                    j += 1
                await asyncio.gather(
                    *(
                        self._agent(client, tree, reqs[k].get("requests", []), lane, True, f"{path}.{k}")
                        for k in range(i, j)
                    )
                )
                i = j
                continue
            if not first:
                await self._think(tree, float(r.get("think_time", 0.0)))
            if self.stop.is_set():
                return
            await self._send(client, tree, r, lane, subagent, True, f"{path}:{i}")
            first = False
            i += 1

    async def _lane(self, client: httpx.AsyncClient, lane: int) -> None:
        first_replay = True
        while not self.stop.is_set():
            tree = self._new_tree(lane)
            reqs = tree.trace.get("requests", [])
            start = 0
            if first_replay and self.cfg.warmup:
                top = [i for i, r in enumerate(reqs) if r.get("type") != "subagent"]
                if top:
                    k = int(self.rng.integers(len(top)))
                    if k > 0:
                        warm = top[k - 1]
                        await self._send(client, tree, reqs[warm], lane, False, False, f"{lane}:{warm}")
                    start = top[k]
            if first_replay and self.cfg.warmup_barrier:
                await self._warmed()
            first_replay = False
            await self._agent(client, tree, reqs[start:], lane, False, f"{lane}")
            if not reqs:
                await asyncio.sleep(0.01)  # an empty trace must not spin the loop

    async def _warmed(self) -> None:
        """This lane's warm-up landed: wait until every lane's has."""
        self.warm_left -= 1
        if self.warm_left == 0:
            self.warm.set()
        await self.warm.wait()

    async def run(self) -> dict:
        cfg = self.cfg
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=max(cfg.concurrency * 4, 16))
        timeout = httpx.Timeout(cfg.endpoint.request_timeout_s, connect=30.0, pool=None)
        async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
            before = None if cfg.warmup_barrier else await scrape(client, cfg.endpoint.base_url)
            t_warm = time.perf_counter()
            lanes = [asyncio.create_task(self._lane(client, i)) for i in range(cfg.concurrency)]
            if cfg.warmup_barrier:  # (or a lane ended early: its barrier count would never come)
                waiter = asyncio.create_task(self.warm.wait())
                await asyncio.wait([waiter, *lanes], return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
                before = await scrape(client, cfg.endpoint.base_url)
            warmup_s = time.perf_counter() - t_warm
            t0 = time.perf_counter()
            pbar = tqdm(
                total=int(math.ceil(cfg.duration_s)),
                disable=cfg.disable_tqdm,
                desc="agentic replay",
                unit="s",
            )
            while (elapsed := time.perf_counter() - t0) < cfg.duration_s:
                await asyncio.sleep(min(1.0, cfg.duration_s - elapsed))
                pbar.n = min(int(time.perf_counter() - t0), pbar.total)
                pbar.set_postfix(done=len(self.sent), in_flight=self.in_flight, refresh=True)
            pbar.close()
            self.stop.set()
            if cfg.grace_s > 0:
                await asyncio.wait(lanes, timeout=cfg.grace_s)
            cancelled = self.in_flight
            for task in lanes:
                task.cancel()
            await asyncio.gather(*lanes, return_exceptions=True)
            wall = time.perf_counter() - t0
            after = await scrape(client, cfg.endpoint.base_url)
        out = self.summarize(wall, cancelled, before, after)
        out.update(warmup_barrier=cfg.warmup_barrier, warmup_phase_s=warmup_s if cfg.warmup_barrier else None)
        return out

    # ------------------------------------------------------------------ results
    def summarize(self, wall_s: float, cancelled: int, before: dict | None, after: dict | None) -> dict:
        cfg = self.cfg
        prof = [s for s in self.sent if s.profiled]
        results = [s.result for s in prof]
        out = compute_agentic_metrics(results, cfg.num_gpus, cfg.percentiles)
        ok = [s for s in prof if s.result.success]
        prompt_total = sum(s.result.prompt_len for s in ok)
        usage_cached = [s.result.cached_tokens for s in ok if s.result.cached_tokens is not None]
        usage_rate = sum(usage_cached) / prompt_total if usage_cached and prompt_total else None
        metrics_rate = prefix_hit_rate_delta(before, after)
        # over the theoretical rate's request set when every one of them reported its cached tokens
        observed = usage_rate if len(usage_cached) == len(ok) or metrics_rate is None else metrics_rate
        overflow = sum(1 for s in prof if _is_context_overflow(s.result))
        out.update(
            {
                "concurrency": cfg.concurrency,
                "duration_s": cfg.duration_s,
                "wall_s": wall_s,
                "time_scale": cfg.time_scale,
                "requests_warmup": sum(1 for s in self.sent if not s.profiled),
                "requests_cancelled": cancelled,
                "traces_started": self.next_trace,
                "prefix_hit_rate_observed": observed,
                "prefix_hit_rate_observed_metrics": metrics_rate,
                "prefix_hit_rate_observed_usage": usage_rate,
                # As replayed: after input truncation, warm-up blocks counted as seen, completed requests.
                "prefix_hit_rate_theoretical": (sum(s.theoretical_hit for s in ok) / prompt_total)
                if prompt_total
                else None,
                "prefix_hit_rate_theoretical_traces": theoretical_hit_rate(cfg.traces),
                "context_overflow_requests": overflow,
                # how the server's steps ran over the run (graph decode steps against eager ones)
                "step_mix": step_mix(before, after, wall_s),
                "submission_valid": (
                    cfg.duration_s >= MIN_VALID_DURATION_S
                    and cfg.time_scale == 1.0
                    and (overflow <= MAX_OVERFLOW_FRACTION * max(len(prof), 1))
                    and cfg.max_input_len is None
                    and cfg.max_output_len is None
                ),
            }
        )
        if cfg.keep_requests:
            out["requests"] = [
                {
                    "lane": s.lane,
                    "start": s.result.start_time,
                    "ttft": s.result.ttft,
                    "latency": s.result.latency,
                    "in": s.result.prompt_len,
                    "out": s.result.output_len,
                    "cached": s.result.cached_tokens,
                    "theoretical_hit": s.theoretical_hit,
                    "error": s.result.error or None,
                }
                for s in prof
            ]
        return out


def _is_context_overflow(r: RequestResult) -> bool:
    msg = r.error.lower()
    return r.status_code == 400 and ("context" in msg or "max_model_len" in msg or "too long" in msg)


async def run_replay(cfg: ReplayConfig) -> dict:
    return await Replayer(cfg).run()


def format_replay_summary(m: dict) -> str:
    def f(v: object) -> str:
        return "n/a" if v is None else (f"{v:.4g}" if isinstance(v, float) else str(v))

    lines = [f"{'=' * 18} hyserve agentic replay (concurrency {m['concurrency']}) {'=' * 18}"]
    for key in (
        "requests_completed",
        "requests_failed",
        "requests_warmup",
        "requests_cancelled",
        "warmup_phase_s",
        "traces_started",
        "window_s",
        "tok_s_per_gpu",
        "output_tok_s_per_gpu",
        "prefix_hit_rate_observed",
        "prefix_hit_rate_observed_metrics",
        "prefix_hit_rate_observed_usage",
        "prefix_hit_rate_theoretical",
        "prefix_hit_rate_theoretical_traces",
        "submission_valid",
    ):
        lines.append(f"{key:<40}{f(m.get(key)):>14}")
    for key in ("tok_s_per_user", "ttft_ms", "itl_ms", "e2el_ms"):
        d = m.get(key, {})
        lines.append(
            f"{key:<40}" + "  ".join(f"{k}={f(v)}" for k, v in d.items() if k not in ("std", "count"))
        )
    for kind, d in (m.get("step_mix") or {}).items():
        lines.append(f"{'steps ' + kind:<40}" + "  ".join(f"{k}={f(v)}" for k, v in d.items()))
    errs = m.get("errors", {})
    for e in errs.get("messages", []):
        lines.append(f"  error x{e['count']}: {e['message']}")
    return "\n".join(lines)
