"""The engine core in its own process, and the asyncio client the server talks to (docs/ARCHITECTURE.md,
"Engine process").

The server process never imports torch: it tokenizes, renders chat and parses outputs, and exchanges small
messages with the engine process over two multiprocessing queues (the protocol and the engine-side loop
are in `engine_core.py`). A reader thread hands the engine's messages to the event loop, which routes
each request's deltas to its `RequestStream`.

A watcher thread waits on the engine process: when it dies, for whatever reason (killed, out of memory,
a kernel fault), every in-flight request fails at once with `EngineDeadError` and `on_dead` is called,
which the server uses to exit so that a supervisor restarts it (vLLM's behaviour).
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import multiprocessing as mp
import multiprocessing.connection
import pickle
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
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
from hyserve.entrypoints.request_stream import RequestStream
from hyserve.sampling_params import SamplingParams
from hyserve.startup import describe_startup, since_process_start
from hyserve.stats_logger import LoggingStatLogger

log = logging.getLogger(__name__)


class AsyncEngineClient:
    """Starts the engine process and multiplexes its output stream onto per-request streams.

    `observer` (optional) gets `on_tokens(stream, n, now)` and `on_finish(stream, reason, now)` calls,
    which is where the server's latency histograms come from. `on_dead(message)` (optional) is called
    once, on the event loop, when the engine dies.
    """

    def __init__(self, cfg: EngineConfig, observer: Any = None) -> None:
        self.cfg = cfg
        self.observer = observer
        self.on_dead: Callable[[str], None] | None = None
        self.info: dict[str, Any] = {}
        self.stats: dict[str, Any] = {}
        self.dead: str | None = None
        self._streams: dict[str, RequestStream] = {}
        # sent, not yet answered by the engine: counted as waiting, and gone with their stream on any end
        self._unacked: set[str] = set()
        self._proc: mp.process.BaseProcess | None = None
        self._reader: threading.Thread | None = None
        self._closing = False
        self.stat_logger = None if cfg.disable_log_stats else LoggingStatLogger()
        self._stats_task: asyncio.Task | None = None

    # ---- lifecycle ----------------------------------------------------------------------------------
    async def start(self, timeout: float = 600.0) -> None:
        ctx = mp.get_context("spawn")
        self._in_q, self._out_q = ctx.Queue(), ctx.Queue()
        # a daemonic process may not start processes, and a parallel engine starts its ranks: it is stopped at exit
        split = self.cfg.tensor_parallel_size > 1
        self._proc = ctx.Process(target=engine_main, args=(self.cfg, self._in_q, self._out_q),
                                 name="hyserve-engine", daemon=not split)
        self._proc.start()
        if split:
            atexit.register(lambda p=self._proc: p.is_alive() and p.terminate())
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
        threading.Thread(target=self._watch, args=(self._proc,), name="hyserve-engine-watch", daemon=True).start()

    @property
    def engine_pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

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
        # Nobody reads the queue any more: exiting must not wait to flush it into a dead engine's pipe.
        self._in_q.cancel_join_thread()
        self._proc = None

    @property
    def is_alive(self) -> bool:
        return self.dead is None and self._proc is not None and self._proc.is_alive()

    # ---- the output stream --------------------------------------------------------------------------
    def _watch(self, proc: mp.process.BaseProcess) -> None:
        """Independent of the reader, which a message cut off by the engine's death could block."""
        mp.connection.wait([proc.sentinel])  # no reaping here: shutdown() may be joining at the same time
        if not self._closing:
            self._loop.call_soon_threadsafe(self._on_dead, f"the engine process exited with code {proc.exitcode}")

    def _read_loop(self) -> None:
        while not self._closing:
            try:
                msg = self._out_q.get(timeout=1.0)
            except queue.Empty:
                if self._proc is None or not self._proc.is_alive():
                    return
                continue
            except (EOFError, OSError):
                return
            if msg[0] == "step":
                try:
                    deltas, stats = pickle.loads(msg[1])
                except Exception as e:  # the protocol itself failed: requests could wait forever
                    self._loop.call_soon_threadsafe(self._on_dead, f"unreadable message from the engine: {e!r}")
                    return
                self._loop.call_soon_threadsafe(self._on_step, deltas, stats)
            elif msg[0] == "dead":
                self._loop.call_soon_threadsafe(self._on_dead, msg[1])
                return

    def _on_step(self, deltas: list[RequestDelta], stats: dict[str, Any]) -> None:
        self.stats = stats
        if self.stat_logger is not None:
            self.stat_logger.record(stats)
        now = time.time()
        for d in deltas:
            self._unacked.discard(d.request_id)
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
        if self.dead is not None or self._closing:
            return
        log.error("engine died: %s", message)
        self.dead = message
        for stream in list(self._streams.values()):
            stream._fail(EngineDeadError(f"the engine died: {message.strip().splitlines()[-1]}"))
        self._streams.clear()
        self._unacked.clear()
        if self.on_dead is not None:
            self.on_dead(message)

    # ---- requests -----------------------------------------------------------------------------------
    @property
    def num_waiting_estimate(self) -> int:
        """Requests the engine holds in its waiting queue, counting adds it has not answered yet."""
        return int(self.stats.get("num_waiting", 0)) + len(self._unacked)

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
        req = EngineRequest(request_id, list(prompt_token_ids), params, priority, cache_salt, stream.arrival_time)
        try:
            payload = pickle.dumps(req, pickle.HIGHEST_PROTOCOL)
        except Exception as e:  # RecursionError: a value nested too deeply, which the API edge should stop
            raise EngineRequestError(f"the request could not be handed to the engine: {e}",
                                     bad_request=isinstance(e, RecursionError)) from e
        self._streams[request_id] = stream
        self._unacked.add(request_id)
        self._in_q.put(("add", request_id, payload))
        try:
            await stream.accepted
        except BaseException:
            self._streams.pop(request_id, None)
            self._unacked.discard(request_id)
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
        self._unacked.discard(request_id)
        if stream is not None and self.observer is not None:
            self.observer.on_finish(stream, "abort", time.time())
        if self.is_alive:
            self._in_q.put(("abort", request_id))


__all__ = [
    "AsyncEngineClient", "CompletionDelta", "EngineDeadError", "EngineRequest", "EngineRequestError",
    "RequestDelta", "RequestStream",
]
