"""The engine core in its own process, and the asyncio client the server talks to (docs/ARCHITECTURE.md,
"Engine process").

The server process never imports torch: it tokenizes, renders chat and parses outputs, and exchanges small
messages with the engine process over two multiprocessing queues (the protocol and the engine-side loop
are in `engine_core.py`). A reader thread hands the engine's messages to the event loop, which routes
each request's deltas to its `RequestStream`.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import queue
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

from hyserve.config import EngineConfig
from hyserve.engine.engine_core import (
    CompletionDelta,
    EngineDeadError,
    EngineRequest,
    EngineRequestError,
    RequestDelta,
    engine_main,
)
from hyserve.sampling_params import SamplingParams
from hyserve.startup import describe_startup, since_process_start
from hyserve.stats_logger import LoggingStatLogger

log = logging.getLogger(__name__)


class RequestStream:
    """The deltas of one request, as an async iterator. Ends after the finishing delta."""

    def __init__(self, client: AsyncEngineClient, request_id: str, arrival_time: float) -> None:
        self.client = client
        self.request_id = request_id
        self.arrival_time = arrival_time
        self.queue: asyncio.Queue[RequestDelta] = asyncio.Queue()
        self.accepted = asyncio.get_running_loop().create_future()
        self.finished = False
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.num_generated = 0

    def _put(self, delta: RequestDelta) -> None:
        if not self.accepted.done():
            if delta.error is not None:
                self.accepted.set_exception(EngineRequestError(delta.error, delta.bad_request))
                self.finished = True
                return
            self.accepted.set_result(True)
        if delta.accepted and not delta.completions and not delta.finished:
            return
        self.queue.put_nowait(delta)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestDelta:
        if self.finished:
            raise StopAsyncIteration
        delta = await self.queue.get()
        if delta.finished:
            self.finished = True
        if delta.error is not None and not delta.completions:
            self.finished = True
            raise EngineRequestError(delta.error, delta.bad_request)
        return delta

    def abort(self) -> None:
        if not self.finished:
            self.finished = True
            self.client.abort(self.request_id)


class AsyncEngineClient:
    """Starts the engine process and multiplexes its output stream onto per-request streams.

    `observer` (optional) gets `on_tokens(stream, n, now)` and `on_finish(stream, reason, now)` calls,
    which is where the server's latency histograms come from.
    """

    def __init__(self, cfg: EngineConfig, observer: Any = None) -> None:
        self.cfg = cfg
        self.observer = observer
        self.info: dict[str, Any] = {}
        self.stats: dict[str, Any] = {}
        self.dead: str | None = None
        self._streams: dict[str, RequestStream] = {}
        self._adds_sent = 0
        self._proc: mp.process.BaseProcess | None = None
        self._reader: threading.Thread | None = None
        self._closing = False
        self.stat_logger = None if cfg.disable_log_stats else LoggingStatLogger()
        self._stats_task: asyncio.Task | None = None

    # ---- lifecycle ----------------------------------------------------------------------------------
    async def start(self, timeout: float = 600.0) -> None:
        ctx = mp.get_context("spawn")
        self._in_q, self._out_q = ctx.Queue(), ctx.Queue()
        self._proc = ctx.Process(target=engine_main, args=(self.cfg, self._in_q, self._out_q),
                                 name="hyserve-engine", daemon=True)
        self._proc.start()
        self._loop = asyncio.get_running_loop()
        msg = await self._loop.run_in_executor(None, self._wait_ready, timeout)
        if msg[0] != "ready":
            raise EngineDeadError(f"the engine failed to start:\n{msg[1]}")
        self.info = msg[1]
        log.info("engine %s", describe_startup(since_process_start(), self.info.get("startup", {})))
        if self.stat_logger is not None:
            self._stats_task = asyncio.create_task(self.stat_logger.run())
        self._reader = threading.Thread(target=self._read_loop, name="hyserve-engine-reader", daemon=True)
        self._reader.start()

    def _wait_ready(self, timeout: float) -> tuple:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                return self._out_q.get(timeout=1.0)
            except queue.Empty:
                if not self._proc.is_alive():
                    return ("dead", f"the engine process exited with code {self._proc.exitcode}")
        return ("dead", f"the engine was not ready after {timeout:.0f} s")

    async def shutdown(self, timeout: float = 10.0) -> None:
        if self._proc is None:
            return
        self._closing = True
        if self._stats_task is not None:
            self._stats_task.cancel()
        if self._proc.is_alive():
            self._in_q.put(("shutdown",))
            await self._loop.run_in_executor(None, self._proc.join, timeout)
        if self._proc.is_alive():
            self._proc.terminate()
            self._proc.join(2.0)
        self._proc = None

    @property
    def is_alive(self) -> bool:
        return self.dead is None and self._proc is not None and self._proc.is_alive()

    # ---- the output stream --------------------------------------------------------------------------
    def _read_loop(self) -> None:
        while not self._closing:
            try:
                msg = self._out_q.get(timeout=1.0)
            except queue.Empty:
                if self._proc is None or not self._proc.is_alive():
                    if not self._closing:
                        self._loop.call_soon_threadsafe(self._on_dead, "the engine process exited")
                    return
                continue
            except (EOFError, OSError):
                return
            if msg[0] == "step":
                self._loop.call_soon_threadsafe(self._on_step, msg[1], msg[2])
            elif msg[0] == "dead":
                self._loop.call_soon_threadsafe(self._on_dead, msg[1])
                return

    def _on_step(self, deltas: list[RequestDelta], stats: dict[str, Any]) -> None:
        self.stats = stats
        if self.stat_logger is not None:
            self.stat_logger.record(stats)
        now = time.time()
        for d in deltas:
            stream = self._streams.get(d.request_id)
            if stream is None:
                continue
            n = max((len(c.token_ids) for c in d.completions), default=0)
            if n:
                if self.observer is not None:
                    self.observer.on_tokens(stream, n, now)
                if stream.first_token_time is None:
                    stream.first_token_time = now
                stream.last_token_time = now
                stream.num_generated += sum(len(c.token_ids) for c in d.completions)
            if d.finished:
                del self._streams[d.request_id]
                if self.observer is not None and d.error is None:
                    reason = next((c.finish_reason for c in d.completions if c.finish_reason), "stop")
                    self.observer.on_finish(stream, reason, now)
            stream._put(d)

    def _on_dead(self, message: str) -> None:
        log.error("engine died: %s", message)
        self.dead = message
        for stream in list(self._streams.values()):
            stream._put(RequestDelta(stream.request_id, finished=True, error="the engine died"))
        self._streams.clear()

    # ---- requests -----------------------------------------------------------------------------------
    @property
    def num_waiting_estimate(self) -> int:
        """Requests the engine holds in its waiting queue, counting adds it has not read yet."""
        return int(self.stats.get("num_waiting", 0)) + self._adds_sent - int(self.stats.get("adds_seen", 0))

    async def submit(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
        priority: int = 0, cache_salt: str | None = None, arrival_time: float | None = None,
    ) -> RequestStream:
        """Send a request and wait for the engine to accept it. Raises EngineRequestError (rejected)."""
        if not self.is_alive:
            raise EngineDeadError(self.dead or "the engine is not running")
        if request_id in self._streams:
            raise EngineRequestError(f"request id '{request_id}' is already in use", bad_request=True)
        stream = RequestStream(self, request_id, arrival_time or time.time())
        self._streams[request_id] = stream
        req = EngineRequest(request_id, list(prompt_token_ids), params, priority, cache_salt, stream.arrival_time)
        self._adds_sent += 1
        self._in_q.put(("add", req))
        try:
            await stream.accepted
        except BaseException:
            self._streams.pop(request_id, None)
            if not stream.accepted.done() or stream.accepted.cancelled():
                self.abort(request_id)
            raise
        return stream

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, **kwargs: Any
    ) -> AsyncIterator[RequestDelta]:
        """Deltas of one request; leaving the loop early (or being cancelled) aborts it."""
        stream = await self.submit(request_id, prompt_token_ids, params, **kwargs)
        try:
            async for delta in stream:
                yield delta
        finally:
            stream.abort()

    def abort(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is not None and self.observer is not None:
            self.observer.on_finish(stream, "abort", time.time())
        if self.is_alive:
            self._in_q.put(("abort", request_id))


__all__ = [
    "AsyncEngineClient", "CompletionDelta", "EngineDeadError", "EngineRequest", "EngineRequestError",
    "RequestDelta", "RequestStream",
]
