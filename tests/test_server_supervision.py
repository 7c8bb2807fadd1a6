"""Supervision: when the engine process dies (here kill -9 under load, as an OOM kill or a kernel fault
would), in-flight requests get a clear 503 error at once, /health stops answering 200, and the server
exits with status 1 so that its supervisor restarts it (vLLM's behaviour) instead of sitting up
answering 503 forever."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx

from tests.server_util import engine_pid, live_server_process

LONG = {"prompt": "hi", "max_tokens": 400, "ignore_eos": True}


def _non_streaming(url: str, out: list) -> None:
    r = httpx.post(f"{url}/v1/completions", json=LONG, timeout=60)
    out.append((r.status_code, r.json()))


def _streaming(url: str, started: threading.Event, out: list) -> None:
    events = []
    with httpx.stream("POST", f"{url}/v1/completions", json={**LONG, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                started.set()
            elif r.status_code != 200:
                events.append(line)  # not accepted before the engine died: a plain error answer
    out.append((r.status_code, events))


def test_killing_the_engine_under_load_fails_in_flight_requests_and_exits_non_zero():
    with live_server_process("--max-model-len", "512") as (url, proc):
        plain, streamed, started = [], [], threading.Event()
        threads = [threading.Thread(target=_non_streaming, args=(url, plain)) for _ in range(2)]
        threads += [threading.Thread(target=_streaming, args=(url, started, streamed)) for _ in range(2)]
        for t in threads:
            t.start()
        assert started.wait(60), "no stream started"
        os.kill(engine_pid(proc), signal.SIGKILL)
        for t in threads:
            t.join(30)
            assert not t.is_alive(), "an in-flight request hangs after the engine died"

        for status, body in plain:
            assert status == 503 and "engine" in body["error"]["message"], body
        for status, events in streamed:
            if status == 200:  # the stream was running: an error event, then the end of the stream
                assert events[-1] == "[DONE]"
                error = json.loads(events[-2])["error"]
            else:
                error = json.loads("".join(events))["error"]
            assert status in (200, 503) and error["code"] == 503 and "exited" in error["message"], error
        deadline = time.monotonic() + 30
        while proc.poll() is None:
            assert time.monotonic() < deadline, "the server outlived its engine"
            try:
                assert httpx.get(f"{url}/health", timeout=2).status_code == 503
            except httpx.TransportError:  # already stopped listening
                pass
            time.sleep(0.2)
        assert proc.returncode == 1
