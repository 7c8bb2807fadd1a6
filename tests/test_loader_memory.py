"""The loader's memory: a sharded bf16 checkpoint streams into bf16 parameters with host memory bounded by
the weights plus about one shard, and no float32 copy of any weight is ever made."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from loader_util import write_medium_checkpoint
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from hyserve.models.checkpoint_writer import write_checkpoint
from hyserve.models.config import parse_config
from hyserve.models.load_report import HOST_SLACK, LoadReport
from hyserve.models.loader import _FP32_PARAMS, build_model, load_model, random_init
from hyserve.models.presets import preset_config

ROOT = Path(__file__).resolve().parents[1]
MIB = 1 << 20

# Run in a fresh process so its peak resident size is the loader's alone. A first small load pays torch's
# one-time start-up costs (thread pools, dispatch tables) before the measurement starts.
_CHILD = """
import json, sys
from hyserve.models import host_memory
from hyserve.models.loader import load_model
load_model("k3-tiny", dtype="bfloat16")
before = host_memory.rss_bytes()
host_memory.reset_peak_rss()
model = load_model(sys.argv[1], dtype="bfloat16", load_format=sys.argv[2])
peak = host_memory.peak_rss_bytes()
print(json.dumps({"increase": peak - before, "weights": sum(p.numel() * p.element_size() for p in model.parameters()),
                  "report": model.load_report.__dict__}))
"""


@pytest.fixture(scope="module")
def medium_checkpoint(tmp_path_factory) -> Path:
    return write_medium_checkpoint(tmp_path_factory.mktemp("medium"))


def _measure(path: Path, load_format: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", _CHILD, str(path), load_format], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc")
@pytest.mark.parametrize("load_format", ["safetensors", "fastsafetensors"])
def test_peak_host_memory_while_loading_stays_within_the_weights_plus_one_and_a_half_shards(
        medium_checkpoint, load_format):
    if load_format == "fastsafetensors":
        pytest.importorskip("fastsafetensors")
    files = sorted(medium_checkpoint.glob("model-*.safetensors"))
    largest = max(f.stat().st_size for f in files)
    assert len(files) >= 3 and largest <= 100_000_000
    got = _measure(medium_checkpoint, load_format)
    # on the CPU the parameters themselves live in host memory; everything else the loader holds is
    # bounded by 1.5 shards. The 64 MiB of slack is far tighter than the 2 GiB the issue allows at scale,
    # so a float32 copy (+680 MB) or a whole-model host copy (+340 MB) fails here.
    assert got["increase"] <= got["weights"] + 1.5 * largest + 64 * MIB, got
    report = LoadReport(**got["report"])
    assert report.host_increase <= report.weight_bytes + report.host_bound - HOST_SLACK + 64 * MIB
    assert report.read_bytes == sum(f.stat().st_size for f in files) and report.num_files == len(files)


class _Float32Allocations(TorchDispatchMode):
    """Sizes of every float32 tensor an op returns, outside the meta device."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.device.type != "meta":
                self.sizes.append(t.numel())
        return out


def test_loading_a_bf16_checkpoint_makes_no_float32_copy_of_any_weight(tmp_path):
    raw = dict(preset_config("k3-tiny"), dtype="bfloat16")
    source = build_model(parse_config(raw), torch.bfloat16, "cpu")
    random_init(source, seed=1)
    write_checkpoint(source, raw, str(tmp_path), torch.bfloat16, shard_bytes=200_000)
    with _Float32Allocations() as mode:
        model = load_model(str(tmp_path), dtype="bfloat16")
    fp32 = {n: p for n, p in model.named_parameters() if n.endswith(_FP32_PARAMS)}
    assert all(p.dtype == torch.float32 for p in fp32.values())
    assert all(p.dtype == torch.bfloat16 for n, p in model.named_parameters() if n not in fp32)
    # only the parameters kept in float32 by design (the largest is a KDA conv: 3 * 64 channels x 4 taps)
    # appear in float32; a float32 staging of any matrix (the embedding: 512 x 64) would show here
    assert max(mode.sizes) <= max(p.numel() for p in fp32.values())
