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

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def live_server(*flags: str, model: str = "k3-tiny", timeout: float = 180.0):
    """Yields the base URL (`http://127.0.0.1:PORT`) once /health answers 200; stops the server after."""
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
        yield url
    finally:
        proc.terminate()  # SIGTERM: uvicorn shuts down gracefully and stops the engine process
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
        os.unlink(log.name)
