"""One request's deltas on the server side, as the `AsyncEngineClient` routes them from the engine."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from hyserve.engine.engine_core import EngineRequestError, RequestDelta

if TYPE_CHECKING:
    from hyserve.entrypoints.engine_client import AsyncEngineClient


class RequestStream:
    """The deltas of one request, as an async iterator. Ends after the finishing delta.

    Each completion's finish reason comes once: later deltas of an already finished completion (n > 1,
    where siblings keep running) are dropped here, so no consumer sees a choice finish twice."""

    def __init__(self, client: AsyncEngineClient, request_id: str, arrival_time: float) -> None:
        self.client = client
        self.request_id = request_id
        self.arrival_time = arrival_time
        self.queue: asyncio.Queue[RequestDelta | BaseException] = asyncio.Queue()
        self.accepted = asyncio.get_running_loop().create_future()
        self.finished = False
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.num_generated = 0
        self._done_indices: set[int] = set()

    def _put(self, delta: RequestDelta) -> None:
        if delta.error is not None and not delta.completions:
            self._fail(EngineRequestError(delta.error, delta.bad_request))
            return
        if not self.accepted.done():
            self.accepted.set_result(True)
        if delta.accepted and not delta.completions and not delta.finished:
            return
        self.queue.put_nowait(delta)

    def _fail(self, exc: BaseException) -> None:
        """End the request with an error: raised by `accepted` before acceptance, by iteration after."""
        if not self.accepted.done():
            self.accepted.set_exception(exc)
            self.finished = True
        else:
            self.queue.put_nowait(exc)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestDelta:
        while True:
            if self.finished:
                raise StopAsyncIteration
            delta = await self.queue.get()
            if isinstance(delta, BaseException):
                self.finished = True
                raise delta
            if delta.finished:
                self.finished = True
            delta.completions = [c for c in delta.completions if c.index not in self._done_indices]
            self._done_indices.update(c.index for c in delta.completions if c.finish_reason is not None)
            if delta.completions or delta.finished or delta.prompt_logprobs is not None:
                return delta

    def abort(self) -> None:
        if not self.finished:
            self.finished = True
            self.client.abort(self.request_id)
