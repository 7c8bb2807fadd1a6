"""Start-up: the time from process start to ready with its phases in the log, and Triton's compilation and
autotuning caches kept between starts under the user's cache directory."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
from server_util import free_port

from hyserve import LLM
from hyserve.compile_cache import configure_compile_caches, describe
from hyserve.models.presets import preset_config
from hyserve.startup import StartupClock, describe_startup, since_process_start

ROOT = Path(__file__).resolve().parents[1]


def test_laps_add_up_per_phase_and_the_rest_is_other():
    t = [0.0]
    clock = StartupClock(clock=lambda: t[0])
    t[0] = 3.0
    clock.lap("load")
    t[0] = 3.5
    clock.lap()  # not a named phase
    t[0] = 4.5
    clock.lap("cache allocation")
    assert clock.phases == {"load": 3.0, "cache allocation": 1.0} and clock.elapsed() == 4.5
    assert describe_startup(6.0, clock.phases) == \
        "ready 6.0 s after process start (load 3.0 s, cache allocation 1.0 s, other 2.0 s)"


def test_the_process_start_is_read_from_the_os_not_from_an_import():
    code = "import time; time.sleep(0.5); from hyserve.startup import since_process_start; print(since_process_start())"
    out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=str(ROOT)),
                         capture_output=True, text=True, check=True)
    assert 0.5 <= float(out.stdout) < 30
    assert 0 < since_process_start() < time.time()


def test_triton_caches_default_to_the_hyserve_cache_directory(tmp_path):
    env = {"XDG_CACHE_HOME": str(tmp_path)}
    added = configure_compile_caches(env)
    assert env["TRITON_CACHE_DIR"] == str(tmp_path / "hyserve" / "triton")
    assert env["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "hyserve" / "inductor")
    assert env["TRITON_CACHE_AUTOTUNING"] == "1" and env["FLA_CACHE_RESULTS"] == "1"
    assert set(added) == set(env) - {"XDG_CACHE_HOME"} and (tmp_path / "hyserve" / "triton").is_dir()
    (tmp_path / "hyserve" / "triton" / "abc123").mkdir()
    assert describe(env).endswith("(1 entries from earlier starts)")


def test_a_users_own_cache_settings_are_kept(tmp_path):
    env = {"HYSERVE_CACHE_ROOT": str(tmp_path / "root"), "TRITON_CACHE_DIR": "/somewhere/else",
           "TRITON_CACHE_AUTOTUNING": "0"}
    configure_compile_caches(env)
    assert env["TRITON_CACHE_DIR"] == "/somewhere/else" and env["TRITON_CACHE_AUTOTUNING"] == "0"
    assert env["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "root" / "inductor")


def test_an_unwritable_cache_root_leaves_the_libraries_defaults(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    env = {"HYSERVE_CACHE_ROOT": str(blocker / "sub")}
    assert configure_compile_caches(env) == {} and "TRITON_CACHE_DIR" not in env


def test_importing_hyserve_sets_the_cache_before_triton_reads_it(tmp_path):
    code = ("import os, hyserve\nprint(os.environ['TRITON_CACHE_DIR'])\n"
            "try:\n    import triton\n    print(triton.knobs.cache.dir)\nexcept ImportError:\n"
            "    print(os.environ['TRITON_CACHE_DIR'])\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRITON_", "HYSERVE_CACHE"))}
    env.update(PYTHONPATH=str(ROOT), XDG_CACHE_HOME=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == [str(tmp_path / "hyserve" / "triton")] * 2


def test_an_engine_logs_its_start_up_phases(caplog):
    with caplog.at_level(logging.INFO, logger="hyserve.engine.llm_engine"):
        llm = LLM("k3-tiny", device="cpu", block_size=16)
    assert set(llm.engine.startup.phases) == {"load", "cache allocation"}  # no graphs on the CPU
    line = next(r.getMessage() for r in caplog.records if "after engine start" in r.getMessage())
    assert line.startswith("engine ready ") and "(load " in line and "Triton cache:" in line


def test_serve_runs_a_config_directory_with_dummy_weights_and_reports_start_up(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(preset_config("k3-tiny")))
    port = free_port()
    log = tmp_path / "server.log"
    cmd = [sys.executable, "-m", "hyserve.entrypoints.serve", str(tmp_path), "--load-format", "dummy",
           "--device", "cpu", "--host", "127.0.0.1", "--port", str(port), "--block-size", "16"]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 180
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "server did not become healthy"
            time.sleep(0.3)
        r = httpx.post(f"{url}/v1/completions", json={"model": str(tmp_path), "prompt": "hi", "max_tokens": 2,
                                                      "ignore_eos": True}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    text = log.read_text()
    assert "random weights (load format dummy)" in text
    assert "engine ready " in text and "after process start (load " in text
