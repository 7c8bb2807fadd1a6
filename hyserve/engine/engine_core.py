"""The engine core's side of the server/engine split: the messages both sides exchange, and the loop that
runs in the engine process (`engine_main`). The server side is `engine_client.AsyncEngineClient`.

    server -> engine   ("add", request_id, pickled EngineRequest) | ("abort", request_id) | ("shutdown",)
    engine -> server   ("ready", info) | ("step", pickled ([RequestDelta], stats)) | ("dead", message)

One "step" message carries every request's news from one engine step, as the engine emits it (token-id
deltas per completion, text deltas, logprobs, finish reasons, errors; `LLMEngine.step_deltas`), the loop's
acceptance acks, and a stats snapshot for /metrics. The loop steps while it has work and blocks on its
queue when idle, so an idle server burns no CPU.

Requests and steps travel pickled by their sender: a multiprocessing queue pickles in a feeder thread,
where a failure (a too-deeply nested value, say) silently drops the message and leaves its request
waiting forever. Pickled up front, a failure belongs to the one request that caused it. Likewise an
exception while adding, aborting or sending one request fails that request alone; only a failing
engine step (the engine's own state) ends the loop.
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
from dataclasses import dataclass
from typing import Any

from hyserve.config import EngineConfig
from hyserve.outputs import CompletionDelta, RequestDelta
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


class EngineRequestError(Exception):
    def __init__(self, message: str, bad_request: bool = False) -> None:
        super().__init__(message)
        self.bad_request = bad_request


class EngineDeadError(RuntimeError):
    pass


# ---------------------------------------------------------------------------------------------------
# The engine process


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
            "config": engine.cfg,  # resolved at engine start
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
                deltas += self.engine.step_deltas()
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
        elif kind == "add":
            deltas.append(self._add(msg[1], msg[2]))

    def _add(self, request_id: str, payload: bytes) -> RequestDelta:
        """Queue one request; any failure is that request's error (ValueError: the client's fault)."""
        try:
            req: EngineRequest = pickle.loads(payload)
            _check_text(req)
            params = req.params
            if params.structured is not None and not hasattr(params.structured, "new_matcher"):
                from hyserve.structured.constraint import compile_spec

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
        return RequestDelta(req.request_id, accepted=True)

    def _drop(self, request_id: str) -> None:
        """Free whatever a failed request may hold in the engine."""
        try:
            self.engine.abort_request(request_id)
        except Exception:
            log.exception("cleaning up request %r failed", request_id)

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
        stats.update(self.engine.kv.pool_stats)
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


__all__ = [
    "CompletionDelta", "EngineDeadError", "EngineRequest", "EngineRequestError", "RequestDelta", "engine_main",
]
