"""The server side of the engine protocol (`AsyncEngineClient`), against a stand-in engine process: a
request that cannot be handed to the engine fails at once, and the waiting count the admission check
reads never drifts from the requests actually in flight, whatever way they end."""

from __future__ import annotations

import asyncio
import pickle
import queue
from types import SimpleNamespace

import pytest

from hyserve.config import EngineConfig
from hyserve.engine.engine_core import RequestDelta
from hyserve.entrypoints.engine_client import AsyncEngineClient, EngineDeadError, EngineRequestError
from hyserve.sampling_params import SamplingParams
from hyserve.structured.constraint import StructuredSpec


def deep_schema(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def client_with_fake_engine() -> AsyncEngineClient:
    client = AsyncEngineClient(EngineConfig(model="k3-tiny"))
    client._proc = SimpleNamespace(is_alive=lambda: True)
    client._in_q = queue.Queue()
    client._loop = asyncio.get_running_loop()
    return client


def sent(client: AsyncEngineClient) -> list[tuple]:
    out = []
    while not client._in_q.empty():
        out.append(client._in_q.get_nowait())
    return out


def test_a_request_that_cannot_be_pickled_fails_at_once_and_is_not_counted():
    async def main():
        client = client_with_fake_engine()
        params = SamplingParams(max_tokens=2, structured=StructuredSpec("json", deep_schema(5000)))
        with pytest.raises(EngineRequestError, match="could not be handed to the engine") as e:
            await asyncio.wait_for(client.submit("deep", [1, 2], params), timeout=10)
        assert e.value.bad_request
        assert client.num_waiting_estimate == 0 and not client._streams and sent(client) == []

    asyncio.run(main())


def test_the_waiting_count_follows_acceptance_cancellation_and_engine_death():
    async def main():
        client = client_with_fake_engine()
        accepted = asyncio.ensure_future(client.submit("a", [1], SamplingParams(max_tokens=2)))
        cancelled = asyncio.ensure_future(client.submit("b", [1], SamplingParams(max_tokens=2)))
        orphaned = asyncio.ensure_future(client.submit("c", [1], SamplingParams(max_tokens=2)))
        await asyncio.sleep(0)
        assert client.num_waiting_estimate == 3
        assert [m[:2] for m in sent(client)] == [("add", "a"), ("add", "b"), ("add", "c")]

        client._on_step([RequestDelta("a", accepted=True)], {"num_waiting": 1})  # the engine queued "a"
        stream = await accepted
        assert client.num_waiting_estimate == 1 + 2
        cancelled.cancel()  # the client went away before the engine answered
        await asyncio.gather(cancelled, return_exceptions=True)
        assert client.num_waiting_estimate == 1 + 1 and sent(client) == [("abort", "b")]

        client._on_dead("the engine process exited with code -9")
        with pytest.raises(EngineDeadError):
            await orphaned
        with pytest.raises(EngineDeadError, match="exited with code -9"):
            await stream.__anext__()
        client.stats = {}
        assert client.num_waiting_estimate == 0

    asyncio.run(main())


def test_every_message_to_the_engine_is_bytes_the_feeder_thread_cannot_fail_on():
    async def main():
        client = client_with_fake_engine()
        task = asyncio.ensure_future(client.submit("a", [1, 2], SamplingParams(max_tokens=2)))
        await asyncio.sleep(0)
        (kind, request_id, payload), = sent(client)
        assert (kind, request_id) == ("add", "a") and pickle.loads(payload).prompt_token_ids == [1, 2]
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(main())
