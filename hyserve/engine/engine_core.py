"""The engine core's side of the server/engine split: the messages both sides exchange, and the loop that
runs in the engine process (`engine_main`). The server side is `engine_client.AsyncEngineClient`.

    server -> engine   ("add", EngineRequest) | ("abort", request_id) | ("shutdown",)
    engine -> server   ("ready", info) | ("step", [RequestDelta], stats) | ("dead", message)

One "step" message carries every request's news from one engine step (token-id deltas per completion,
text deltas, logprobs, finish reasons, errors, acceptance acks) plus a stats snapshot for /metrics. The
loop steps while it has work and blocks on its queue when idle, so an idle server burns no CPU.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import signal
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

from hyserve.config import EngineConfig
from hyserve.sampling_params import SamplingParams

log = logging.getLogger(__name__)


@dataclass
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams  # `structured` is a StructuredSpec (data); the engine process compiles it
    priority: int = 0
    cache_salt: str | None = None
    arrival_time: float = 0.0


@dataclass
class CompletionDelta:
    index: int
    token_ids: list[int]
    text: str
    logprobs: list[dict] | None = None  # new positions only: token id -> Logprob
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class RequestDelta:
    request_id: str
    completions: list[CompletionDelta] = field(default_factory=list)
    finished: bool = False
    accepted: bool = False  # the engine took the request (sent once, before any tokens)
    error: str | None = None
    bad_request: bool = False  # the error is the client's fault (HTTP 400), not the engine's
    num_cached_tokens: int = 0
    # Sent once, whole, with the first delta after prefill (one entry per prompt token, the first None)
    prompt_logprobs: list[dict | None] | None = None


class EngineRequestError(Exception):
    def __init__(self, message: str, bad_request: bool = False) -> None:
        super().__init__(message)
        self.bad_request = bad_request


class EngineDeadError(RuntimeError):
    pass


# ---------------------------------------------------------------------------------------------------
# The engine process


class _DeltaTracker:
    """Turns the engine's cumulative outputs into per-step deltas, holding back text that might be
    the start of a stop string (the engine cuts a matched stop string out of the text)."""

    def __init__(self, params: SamplingParams) -> None:
        self.holdback = max((len(s) for s in params.stop or ()), default=1) - 1
        self.sent: dict[int, tuple[int, int, int]] = {}  # index -> (tokens, chars, logprobs) sent
        self.wants_prompt_logprobs = params.prompt_logprobs is not None

    def prompt_logprobs(self, out) -> list | None:
        """The request's prompt logprobs, once they are complete and not yet sent."""
        pl = out.prompt_logprobs
        if not self.wants_prompt_logprobs or pl is None:
            return None
        if len(pl) < len(out.prompt_token_ids or ()) and not out.finished:
            return None  # prefill still running (chunked)
        self.wants_prompt_logprobs = False
        return list(pl)

    def delta(self, comp) -> CompletionDelta | None:
        ntok, nchar, nlp = self.sent.get(comp.index, (0, 0, 0))
        done = comp.finish_reason is not None
        end = len(comp.text) if done else max(nchar, len(comp.text) - self.holdback)
        lps = comp.logprobs[nlp:] if comp.logprobs is not None else None
        d = CompletionDelta(comp.index, comp.token_ids[ntok:], comp.text[nchar:end], lps or None,
                            comp.finish_reason, comp.stop_reason)
        self.sent[comp.index] = (len(comp.token_ids), end, nlp + len(lps or ()))
        if not d.token_ids and not d.text and not done:
            return None
        return d


def engine_main(cfg: EngineConfig, in_q, out_q) -> None:
    """Child-process entry point: build the engine, then serve the queue until shutdown."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s engine: %(message)s")
    # Ctrl+C reaches the whole process group; the server decides when the engine stops (a "shutdown"
    # message after in-flight requests are dropped), so the engine must not die mid-step on SIGINT.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        from hyserve.engine.llm_engine import LLMEngine

        engine = LLMEngine(cfg)
        info = {
            "max_model_len": engine.max_model_len,
            "vocab_size": engine.model_config.vocab_size,
            "tokenizer_family": engine.model_config.tokenizer_family,
            "eos_token_ids": list(engine.eos_token_ids),
            "num_blocks": engine.cache_plan.num_blocks,
            "num_state_slots": engine.cache_plan.num_slots,
            "num_checkpoint_slots": engine.cache_plan.num_checkpoint_slots,
            "block_size": engine.kv.block_size,
            "max_num_seqs": cfg.max_num_seqs,
            "cache_description": engine.cache_plan.describe(),
            "device": str(engine.device),
            "startup": dict(engine.startup.phases),  # seconds per start-up phase, for the server's log
        }
    except Exception:
        out_q.put(("dead", traceback.format_exc()))
        return
    out_q.put(("ready", info))
    try:
        _EngineLoop(engine, in_q, out_q).run()
    except Exception:
        log.exception("engine loop failed")
        out_q.put(("dead", traceback.format_exc()))


class _EngineLoop:
    def __init__(self, engine, in_q, out_q) -> None:
        self.engine, self.in_q, self.out_q = engine, in_q, out_q
        self.trackers: dict[str, _DeltaTracker] = {}
        self.adds_seen = 0
        self.parent_pid = os.getppid()

    def run(self) -> None:
        while True:
            deltas: list[RequestDelta] = []
            # Block only when idle: a running batch must not wait on the queue.
            idle = not self.engine.has_unfinished_requests()
            for msg in self._drain(block=idle):
                if msg[0] == "shutdown":
                    return
                self._handle(msg, deltas)
            if self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    d = self._delta(out)
                    if d is not None:
                        deltas.append(d)
            self.out_q.put(("step", deltas, self._stats()))

    def _drain(self, block: bool) -> list[tuple]:
        msgs: list[tuple] = []
        while block and not msgs:
            try:
                msgs.append(self.in_q.get(timeout=1.0))
            except queue.Empty:
                # An orphaned engine (the server was killed) would otherwise wait here forever.
                if os.getppid() != self.parent_pid:
                    return [("shutdown",)]
        while True:
            try:
                msgs.append(self.in_q.get_nowait())
            except queue.Empty:
                return msgs

    def _handle(self, msg: tuple, deltas: list[RequestDelta]) -> None:
        kind = msg[0]
        if kind == "abort":
            self.engine.abort_request(msg[1])
            self.trackers.pop(msg[1], None)
        elif kind == "add":
            self.adds_seen += 1
            req: EngineRequest = msg[1]
            try:
                params = req.params
                if params.structured is not None and not hasattr(params.structured, "new_matcher"):
                    from hyserve.engine.structured import compile_spec

                    params.structured = compile_spec(
                        params.structured, self.engine.tokenizer, self.engine.model_config.vocab_size
                    )
                self.engine.add_request(
                    req.request_id, req.prompt_token_ids, params, arrival_time=req.arrival_time,
                    priority=req.priority, cache_salt=req.cache_salt,
                )
            except ValueError as e:
                deltas.append(RequestDelta(req.request_id, finished=True, error=str(e), bad_request=True))
                return
            self.trackers[req.request_id] = _DeltaTracker(req.params)
            deltas.append(RequestDelta(req.request_id, accepted=True))

    def _delta(self, out) -> RequestDelta | None:
        tracker = self.trackers.get(out.request_id)
        if tracker is None:
            return None
        if out.finished:
            del self.trackers[out.request_id]
        comps = [d for c in out.outputs if (d := tracker.delta(c)) is not None]
        prompt_lps = tracker.prompt_logprobs(out)
        if not comps and not out.finished and prompt_lps is None:
            return None
        return RequestDelta(out.request_id, comps, out.finished, error=out.error,
                            num_cached_tokens=out.num_cached_tokens, prompt_logprobs=prompt_lps)

    def _stats(self) -> dict[str, Any]:
        stats = dataclasses.asdict(self.engine.stats)
        # The engine refreshes these only inside step(); an abort on an idle engine must show at once.
        sched = self.engine.scheduler
        stats.update(num_running=len(sched.running), num_waiting=len(sched.waiting),
                     kv_cache_usage=self.engine.kv.usage)
        stats["adds_seen"] = self.adds_seen
        stats["time"] = time.time()
        return stats


__all__ = [
    "CompletionDelta", "EngineDeadError", "EngineRequest", "EngineRequestError", "RequestDelta", "engine_main",
]
