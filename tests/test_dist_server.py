"""`hyserve serve -tp 2` on gloo processes: greedy completions equal one process's; a rank killed under
load fails the in-flight requests with a clear 503 and the server exits non-zero (the single-process
engine-death path); a layout the model cannot split keeps the server from starting."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
from dist_util import all_exit

from hyserve import LLM, SamplingParams
from tests.server_util import ROOT, engine_pid, live_server_process

PROMPTS = ["The quick brown fox", "Ranks of a tensor-parallel engine"]


def _rank_pids(server: subprocess.Popen) -> list[int]:
    """The engine process's rank workers (its spawned children)."""
    engine = engine_pid(server)
    children = Path(f"/proc/{engine}/task/{engine}/children").read_text().split()
    return [int(c) for c in children if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]


def _complete(url: str, prompt: str, max_tokens: int, out: list | None = None) -> dict:
    r = httpx.post(f"{url}/v1/completions", timeout=120,
                   json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
    if out is not None:
        out.append((r.status_code, r.json()))
    return r.json()


def test_greedy_completions_equal_one_process_and_a_killed_rank_stops_the_server():
    want = LLM("k3-tiny", device="cpu", kv_cache_memory_bytes=4 << 20).generate(
        PROMPTS, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)
    with live_server_process("-tp", "2", "--max-model-len", "512", "--kv-cache-memory-bytes", str(4 << 20)) as (url, proc):
        got = [_complete(url, p, 8)["choices"][0]["text"] for p in PROMPTS]
        assert got == [o.outputs[0].text for o in want]

        ranks = _rank_pids(proc)
        assert len(ranks) == 2
        answers: list = []
        long = threading.Thread(target=_complete, args=(url, "hi", 400, answers))
        long.start()
        time.sleep(1.0)
        os.kill(ranks[1], signal.SIGKILL)
        long.join(60)
        assert not long.is_alive(), "an in-flight request hangs after a rank died"
        status, body = answers[0]
        assert status == 503 and "rank 1" in body["error"]["message"], body
        proc.wait(60)
        assert proc.returncode == 1
        assert all_exit(ranks)


def test_a_layout_the_model_cannot_split_keeps_the_server_from_starting():
    r = subprocess.run([sys.executable, "-m", "hyserve.entrypoints.serve", "k3-tiny", "--device", "cpu", "--port", "0",
                        "--tensor-parallel-size", "8"], cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "num_attention_heads (MLA heads) = 4 is not divisible by 8" in r.stdout + r.stderr
