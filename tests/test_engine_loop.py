"""The engine process's loop (`engine_core._EngineLoop`) survives any one request's data: an exception
while adding, aborting or reporting a request fails that request alone (its error reaches the server),
the loop goes on serving the others, and the failed request holds no cache page or state slot after.

The loop runs in a thread over plain queues, around a real k3-tiny engine.
"""

from __future__ import annotations

import pickle
import queue
import threading
import time

import pytest

from hyserve import SamplingParams
from hyserve.engine.engine_core import EngineRequest, RequestDelta, _EngineLoop
from hyserve.engine.output_processor import ParentRequest

PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


class LoopHarness:
    def __init__(self, engine) -> None:
        self.in_q: queue.Queue = queue.Queue()
        self.out_q: queue.Queue = queue.Queue()
        self.loop = _EngineLoop(engine, self.in_q, self.out_q)
        self.thread = threading.Thread(target=self.loop.run, daemon=True)
        self.deltas: dict[str, list[RequestDelta]] = {}

    def add(self, request_id: str, params: SamplingParams = PARAMS, **kwargs) -> None:
        req = EngineRequest(request_id, [5, 6, 7], params, **kwargs)
        self.in_q.put(("add", request_id, pickle.dumps(req)))

    def wait_finished(self, *request_ids: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not all(any(d.finished for d in self.deltas.get(r, ())) for r in request_ids):
            assert self.thread.is_alive(), "the engine loop ended"
            kind, payload = self.out_q.get(timeout=max(0.1, deadline - time.monotonic()))
            assert kind == "step"
            deltas, _ = pickle.loads(payload)
            for d in deltas:
                self.deltas.setdefault(d.request_id, []).append(d)

    def error(self, request_id: str) -> str | None:
        return next((d.error for d in self.deltas[request_id] if d.error), None)

    def tokens(self, request_id: str) -> int:
        return sum(len(c.token_ids) for d in self.deltas[request_id] for c in d.completions)

    def bad_beside_good(self) -> str:
        """Run a long request "bad" beside a short "good" one; the good one must finish whole. Returns
        bad's error."""
        self.add("bad", SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
        self.add("good")
        self.wait_finished("bad", "good")
        assert self.error("good") is None and self.tokens("good") == 6
        return self.error("bad")

    def stop(self) -> None:
        self.in_q.put(("shutdown",))
        self.thread.join(30)
        assert not self.thread.is_alive()


@pytest.fixture
def harness(make_engine):
    h = LoopHarness(make_engine())
    h.thread.start()
    yield h
    h.stop()


def test_an_exception_while_adding_a_request_fails_it_alone(harness, monkeypatch):
    engine = harness.loop.engine
    real_add = engine.add_request

    def add(request_id, *args, **kwargs):
        real_add(request_id, *args, **kwargs)  # queued, then fails: the loop must take it back out
        if request_id == "bad":
            raise RuntimeError("boom")

    monkeypatch.setattr(engine, "add_request", add)
    assert "boom" in harness.bad_beside_good()
    harness.add("after")
    harness.wait_finished("after")
    assert harness.tokens("after") == 6


def test_an_unreadable_request_payload_fails_that_request_alone(harness):
    harness.in_q.put(("add", "garbled", b"not a pickle"))
    harness.add("good")
    harness.wait_finished("garbled", "good")
    assert harness.error("garbled") and harness.tokens("good") == 6


def test_text_that_is_not_valid_unicode_is_refused_before_the_engine_step(harness):
    """A lone surrogate in the cache salt used to fail inside the scheduler's step, killing the loop."""
    harness.add("salted", cache_salt="\udfff")
    harness.add("stopped", SamplingParams(max_tokens=4, stop=["\ud800"]))
    harness.add("good")
    harness.wait_finished("salted", "stopped", "good")
    assert "unicode" in harness.error("salted").lower() and "unicode" in harness.error("stopped").lower()
    assert harness.tokens("good") == 6


def test_an_exception_while_aborting_leaves_the_loop_running(harness, monkeypatch):
    engine = harness.loop.engine
    real_abort = engine.abort_request

    def abort(request_id):
        real_abort(request_id)
        raise RuntimeError("abort failed")

    monkeypatch.setattr(engine, "abort_request", abort)
    harness.in_q.put(("abort", "nobody"))
    harness.add("good")
    harness.wait_finished("good")
    assert harness.tokens("good") == 6


def test_an_exception_in_one_requests_output_fails_it_alone(harness, monkeypatch):
    real_delta = ParentRequest.delta

    def delta(parent):
        if parent.request_id == "bad":
            raise RuntimeError("cannot report")
        return real_delta(parent)

    monkeypatch.setattr(ParentRequest, "delta", delta)
    assert "cannot report" in harness.bad_beside_good()


def test_an_output_that_cannot_be_sent_fails_that_request_alone(harness, monkeypatch):
    real_delta = ParentRequest.delta

    def delta(parent):
        d = real_delta(parent)
        if d is not None and parent.request_id == "bad":
            d.prompt_logprobs = [lambda: None]  # not picklable
        return d

    monkeypatch.setattr(ParentRequest, "delta", delta)
    assert "could not be sent" in harness.bad_beside_good()
