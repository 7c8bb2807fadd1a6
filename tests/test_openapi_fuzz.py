"""Schemathesis over every operation of a live k3-tiny server's /openapi.json, with every check it has
(bounded examples, a fixed seed): no 5xx, no hang (a request timeout), and no response the document does
not declare (status code, content type, headers, body or event schema); schema-valid requests accepted
and invalid ones (wrong JSON types, out-of-range values) refused. Settings: tests/data/schemathesis.toml.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from tests.server_util import live_server

CONFIG = Path(__file__).parent / "data" / "schemathesis.toml"


def test_schemathesis_finds_nothing_the_document_does_not_declare(tmp_path):
    # n <= 4: a schema-valid n of 16384 is minutes of decoding on a CPU, which the fuzzer would report as a hang
    with live_server("--max-model-len", "512", env={"HYSERVE_MAX_N_SEQUENCES": "4"}) as url:
        cmd = [sys.executable, "-m", "schemathesis.cli", "--config-file", str(CONFIG), "run", f"{url}/openapi.json",
               "--max-examples", "10", "--seed", "25", "--request-timeout", "60", "--workers", "1",
               "--phases", "examples,coverage,fuzzing", "--generation-database", "none", "--no-color",
               "--continue-on-failure"]
        run = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-20000:] + run.stderr[-5000:]
    assert re.search(r"Operations:\s+(\d+) selected / \1 total", run.stdout), run.stdout[:2000]
