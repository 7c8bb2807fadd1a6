"""`hyserve serve` in a subprocess on a free local port, for tests and benchmarks against the HTTP API."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from hyserve import envs

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_pid(server: subprocess.Popen) -> int:
    """The engine process the server spawned (its multiprocessing child running `spawn_main`)."""
    for child in Path(f"/proc/{server.pid}/task/{server.pid}/children").read_text().split():
        if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
            return int(child)
    raise LookupError("the server has no engine process")


def server_environ(device: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The server's environment: this process's, with this checkout first on PYTHONPATH and the caller's
    path after it (packages installed with `pip --target` live there), and `extra`."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    threads = {"OMP_NUM_THREADS": "1"} if device == "cpu" else {}  # tiny CPU matmuls: threads only cost
    return envs.child_environ(PYTHONPATH=path, **threads, **(extra or {}))


@contextmanager
def serve_subprocess(*flags: str, model: str = "k3-tiny", timeout: float = 180.0,
                     env: dict[str, str] | None = None, device: str = "cpu",
                     log_path: str | None = None) -> Iterator[tuple[str, subprocess.Popen]]:
    """Yields (base URL, the server's Popen) once /health answers 200; stops the server after.
    `env`: extra environment variables for the server (which runs this checkout's code on `device`);
    `log_path`: keep the server's output there (by default a temporary file, removed after)."""
    port = free_port()
    env = server_environ(device, env)
    cmd = [sys.executable, "-m", "hyserve.entrypoints.serve", model, "--host", "127.0.0.1",
           "--port", str(port), "--device", device, *flags]
    if log_path:
        log = open(log_path, "w")
    else:
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
        if not log_path:
            os.unlink(log.name)
