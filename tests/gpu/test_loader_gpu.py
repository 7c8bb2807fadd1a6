"""The loader on CUDA: parameters allocated once in bf16 on the device, device memory while loading equal to
the weights (no staging), and the same weights as a CPU load of the same directory."""

from __future__ import annotations

import pytest
import torch
from loader_util import write_medium_checkpoint

from hyserve.models.loader import load_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
MIB = 1 << 20


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_medium_checkpoint(tmp_path_factory.mktemp("medium"))


def _load(path, load_format: str):
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    model = load_model(str(path), device="cuda", load_format=load_format)
    return model, before


def test_safetensors_load_uses_no_device_memory_beyond_the_weights(checkpoint):
    model, before = _load(checkpoint, "safetensors")
    report = model.load_report
    assert all(p.device.type == "cuda" for p in model.parameters())
    # the allocator rounds each parameter up to 512 bytes: a few hundred small parameters, under 2 MiB
    assert report.weight_bytes <= report.device_allocated - before <= report.weight_bytes + 2 * MIB
    assert report.device_peak - before <= report.weight_bytes + 16 * MIB  # per-tensor dtype conversions at most
    cpu = load_model(str(checkpoint))
    for (name, a), (_, b) in zip(model.named_parameters(), cpu.named_parameters()):
        assert a.dtype == b.dtype and torch.equal(a.cpu(), b), name


def test_fastsafetensors_stages_at_most_one_shard_on_the_device(checkpoint):
    pytest.importorskip("fastsafetensors")
    model, before = _load(checkpoint, "fastsafetensors")
    report = model.load_report
    assert report.device_allocated - before <= report.weight_bytes + 2 * MIB
    assert report.device_peak - before <= report.weight_bytes + report.largest_file_bytes + 64 * MIB
    cpu = load_model(str(checkpoint))
    for (name, a), (_, b) in zip(model.named_parameters(), cpu.named_parameters()):
        assert torch.equal(a.cpu(), b), name
