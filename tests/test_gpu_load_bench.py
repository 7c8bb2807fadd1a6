"""benchmarks/gpu_load.py on the CPU: the same write / load-from-disk steps the device run takes, on a tiny
preset, so the script the lead runs on the H200 is known to work end to end."""

from __future__ import annotations

import sys

import pytest
from bench_util import BENCHMARKS, load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("gpu_load")


def test_the_cut_keeps_the_first_layers_and_their_kinds(bench):
    raw = bench.cut_config("kimi-linear-48b-a3b", 12)
    lin = raw["linear_attn_config"]
    assert raw["num_hidden_layers"] == 12 and lin["full_attn_layers"] == [4, 8, 12]
    assert lin["kda_layers"] == [i for i in range(1, 13) if i not in (4, 8, 12)]
    # 12 of the 27 layers are the ~42 GB the device's 64 GB disk holds with room to spare
    assert 40e9 < bench.checkpoint_bytes(raw) < 45e9


def test_a_dry_run_writes_loads_from_disk_and_reports_the_bound(bench, tmp_path, capsys):
    directory = tmp_path / "ckpt"
    sys.path.insert(0, str(BENCHMARKS))  # main() imports gpu_common for the report
    try:
        rc = bench.main(["--preset", "kimi-linear-tiny", "--layers", "3", "--device", "cpu", "--shard-gb", "0.0001",
                         "--modes", "write,disk", "--dir", str(directory), "--no-append"])
    finally:
        sys.path.remove(str(BENCHMARKS))
    out = capsys.readouterr().out
    assert rc == 0, out[-3000:]
    row = next(line for line in out.splitlines() if line.startswith("| 3-layer directory | safetensors |"))
    assert "(within)" in row and "GB/s" in row and "ready after" not in row
    assert "Written: " in out and "Code state: " in out
    assert not directory.exists()  # removed without --keep
