"""Start a live `hyserve serve` in a subprocess on a free local port, for tests against the HTTP API."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def live_server(*flags: str, model: str = "k3-tiny", timeout: float = 180.0):
    """Yields the base URL (`http://127.0.0.1:PORT`) once /health answers 200; stops the server after."""
    with live_server_process(*flags, model=model, timeout=timeout) as (url, _):
        yield url


def engine_pid(server: subprocess.Popen) -> int:
    """The engine process the server spawned (its multiprocessing child running `spawn_main`)."""
    for child in Path(f"/proc/{server.pid}/task/{server.pid}/children").read_text().split():
        if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
            return int(child)
    raise LookupError("the server has no engine process")


@contextmanager
def live_server_process(*flags: str, model: str = "k3-tiny", timeout: float = 180.0):
    """Like `live_server`, yielding (url, the server's Popen)."""
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")  # tiny matmuls: threads only cost
    cmd = [sys.executable, "-m", "hyserve.entrypoints.serve", model, "--host", "127.0.0.1",
           "--port", str(port), "--device", "cpu", *flags]
    log = tempfile.NamedTemporaryFile("w", prefix="hyserve_server_", suffix=".log", delete=False)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}; see {log.name}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("server did not become healthy")
            time.sleep(0.3)
        yield url, proc
    finally:
        proc.terminate()  # SIGTERM: uvicorn shuts down gracefully and stops the engine process
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
        os.unlink(log.name)


def metrics(server: str) -> dict[tuple[str, tuple], float]:
    """Every sample of /metrics as {(name, sorted labels): value}, via prometheus_client's parser."""
    text = httpx.get(f"{server}/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def metric(server: str, name: str, **labels: str) -> float:
    return sum(v for (n, ls), v in metrics(server).items() if n == name and all((k, labels[k]) in ls for k in labels))


def pool_leaks(server: str) -> list[str]:
    """What an idle server's pool gauges show held beyond the prefix cache's own retention (empty: none)."""
    m = {n.removeprefix("hyserve:"): v for (n, _), v in metrics(server).items() if n.startswith("hyserve:")}
    checks = [
        ("running state slots", m["state_slots_total"] - m["state_slots_free"]),
        ("KV blocks", m["kv_blocks_total"] - m["kv_blocks_free"] - m["kv_blocks_pinned"]),
        ("checkpoint slots", m["checkpoint_slots_total"] - m["checkpoint_slots_free"] - m["prefix_cache_checkpoints"]),
    ]
    return [f"{held:g} {name} held" for name, held in checks if held]


def wait_idle(server: str, timeout: float = 30.0) -> list[str]:
    """Wait until nothing runs or waits and the pools are back to idle; returns the leaks left at the end."""
    deadline = time.monotonic() + timeout
    while True:
        busy = metric(server, "vllm:num_requests_running") + metric(server, "vllm:num_requests_waiting")
        leaks = pool_leaks(server)
        if (not busy and not leaks) or time.monotonic() > deadline:
            return leaks + ([f"{busy:g} requests still running or waiting"] if busy else [])
        time.sleep(0.2)
