"""The engine core's side of the server/engine split: the messages both sides exchange, and the loop that
runs in the engine process (`engine_main`). The server side is `engine_client.AsyncEngineClient`.

    server -> engine   ("add", request_id, pickled EngineRequest) | ("abort", request_id) | ("shutdown",)
    engine -> server   ("ready", info) | ("step", pickled ([RequestDelta], stats)) | ("dead", message)

One "step" message carries every request's news from one engine step (token-id deltas per completion,
text deltas, logprobs, finish reasons, errors, acceptance acks) plus a stats snapshot for /metrics. The
loop steps while it has work and blocks on its queue when idle, so an idle server burns no CPU.

Requests and steps travel pickled by their sender: a multiprocessing queue pickles in a feeder thread,
where a failure (a too-deeply nested value, say) silently drops the message and leaves its request
waiting forever. Pickled up front, a failure belongs to the one request that caused it. Likewise an
exception while adding, aborting or reporting one request fails that request alone; only a failing
`engine.step()` (the engine's own state) ends the loop.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
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
        self.parent_pid = os.getppid()

    def run(self) -> None:
        self._send_step([])  # the idle gauges, before any request arrives
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
                    d = self._delta_or_error(out)
                    if d is not None:
                        deltas.append(d)
            self._send_step(deltas)

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
            try:
                self.engine.abort_request(msg[1])
            except Exception:  # the server has already dropped the request: nobody waits for an error
                log.exception("aborting request %r failed", msg[1])
            self.trackers.pop(msg[1], None)
        elif kind == "add":
            deltas.append(self._add(msg[1], msg[2]))

    def _add(self, request_id: str, payload: bytes) -> RequestDelta:
        """Queue one request; any failure is that request's error (ValueError: the client's fault)."""
        try:
            req: EngineRequest = pickle.loads(payload)
            _check_text(req)
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
        except ValueError as e:  # add_request queued nothing
            return RequestDelta(request_id, finished=True, error=str(e), bad_request=True)
        except Exception as e:
            log.exception("adding request %r failed", request_id)
            self._drop(request_id)
            return RequestDelta(request_id, finished=True, error=f"the engine could not add the request: {e!r}")
        self.trackers[req.request_id] = _DeltaTracker(req.params)
        return RequestDelta(req.request_id, accepted=True)

    def _drop(self, request_id: str) -> None:
        """Free whatever a failed request may hold in the engine."""
        self.trackers.pop(request_id, None)
        try:
            self.engine.abort_request(request_id)
        except Exception:
            log.exception("cleaning up request %r failed", request_id)

    def _delta_or_error(self, out) -> RequestDelta | None:
        try:
            return self._delta(out)
        except Exception as e:
            log.exception("reporting request %r failed", out.request_id)
            self._drop(out.request_id)
            return RequestDelta(out.request_id, finished=True, error=f"the engine failed on this request: {e!r}")

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

    def _send_step(self, deltas: list[RequestDelta]) -> None:
        stats = self._stats()
        try:
            payload = pickle.dumps((deltas, stats), pickle.HIGHEST_PROTOCOL)
        except Exception:  # find the delta that cannot travel and fail its request alone
            kept = []
            for d in deltas:
                try:
                    pickle.dumps(d, pickle.HIGHEST_PROTOCOL)
                    kept.append(d)
                except Exception as e:
                    log.exception("sending request %r's output failed", d.request_id)
                    self._drop(d.request_id)
                    kept.append(RequestDelta(d.request_id, finished=True, error=f"its output could not be sent: {e!r}"))
            payload = pickle.dumps((kept, stats), pickle.HIGHEST_PROTOCOL)
        self.out_q.put(("step", payload))

    def _stats(self) -> dict[str, Any]:
        stats = dataclasses.asdict(self.engine.stats)
        # The engine refreshes these only inside step(); an abort on an idle engine must show at once.
        sched = self.engine.scheduler
        stats.update(num_running=len(sched.running), num_waiting=len(sched.waiting),
                     kv_cache_usage=self.engine.kv.usage)
        stats.update(_pool_stats(self.engine))
        stats["time"] = time.time()
        return stats


def _check_text(req: EngineRequest) -> None:
    """Text the engine encodes to bytes (the cache salt, stop strings) must be valid Unicode: a lone
    surrogate would otherwise fail inside a later engine step, which every running request shares."""
    for name, text in [("cache_salt", req.cache_salt), *(("stop", s) for s in req.params.stop or ())]:
        if text is not None:
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ValueError(f"{name} is not valid Unicode: {e.reason} at position {e.start}") from e


def _pool_stats(engine) -> dict[str, int]:
    """Free and total sizes of the cache pools, for the /metrics gauges that show a leak."""
    kv, pc = engine.kv, engine.prefix_cache
    return {
        "kv_blocks_free": kv.blocks.num_free, "kv_blocks_capacity": kv.blocks.num_blocks,
        "kv_blocks_pinned": len(pc.pinned_blocks) if pc is not None else 0,
        "prefix_cache_checkpoints": len(pc.ckpts) if pc is not None else 0,
        "state_slots_free": kv.slots.num_free, "state_slots_capacity": kv.slots.num_slots,
        "checkpoint_slots_free": kv.checkpoint_slots.num_free,
        "checkpoint_slots_capacity": kv.checkpoint_slots.num_slots,
    }


__all__ = [
    "CompletionDelta", "EngineDeadError", "EngineRequest", "EngineRequestError", "RequestDelta", "engine_main",
]
