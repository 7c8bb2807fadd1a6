"""Start a live `hyserve serve` in a subprocess on a free local port, for tests against the HTTP API."""

from __future__ import annotations

from contextlib import contextmanager

import httpx
from prometheus_client.parser import text_string_to_metric_families

# tests import these from here
from hyserve.bench.live import ROOT, engine_pid, free_port, serve_subprocess  # noqa: F401
from hyserve.bench.soak import pool_leaks, wait_idle  # noqa: F401

live_server_process = serve_subprocess  # yields (url, Popen)


@contextmanager
def live_server(*flags: str, model: str = "k3-tiny", timeout: float = 180.0, env: dict[str, str] | None = None):
    """Yields the base URL (`http://127.0.0.1:PORT`) once /health answers 200; stops the server after.
    `env`: extra environment variables for the server."""
    with serve_subprocess(*flags, model=model, timeout=timeout, env=env) as (url, _):
        yield url


def metrics(server: str) -> dict[tuple[str, tuple], float]:
    """Every sample of /metrics as {(name, sorted labels): value}, via prometheus_client's parser."""
    text = httpx.get(f"{server}/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def metric(server: str, name: str, **labels: str) -> float:
    return sum(v for (n, ls), v in metrics(server).items() if n == name and all((k, labels[k]) in ls for k in labels))
