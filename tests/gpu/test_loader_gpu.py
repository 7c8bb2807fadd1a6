"""The loader on CUDA: parameters allocated once in bf16 on the device, device memory while loading equal to
the weights (no staging), and the same weights as a CPU load of the same directory."""

from __future__ import annotations

import pytest
import torch

from hyserve.models.checkpoint_writer import write_checkpoint
from hyserve.models.config import parse_config
from hyserve.models.loader import build_model, load_model, random_init
from hyserve.models.presets import preset_config

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
MIB = 1 << 20
# about 340 MB of bf16 weights in shards of at most 100 MB
_MEDIUM = dict(vocab_size=32768, hidden_size=1024, intermediate_size=2048, num_experts=16, moe_intermediate_size=512,
               num_attention_heads=8, num_key_value_heads=8, kv_lora_rank=256, qk_nope_head_dim=64,
               qk_rope_head_dim=32, v_head_dim=64, dtype="bfloat16",
               linear_attn_config={"num_heads": 8, "head_dim": 128, "short_conv_kernel_size": 4,
                                   "kda_layers": [1, 2, 3], "full_attn_layers": [4]})


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    raw = dict(preset_config("kimi-linear-tiny"), **_MEDIUM)
    model = build_model(parse_config(raw), torch.bfloat16, "cpu")
    random_init(model, seed=0)
    out = tmp_path_factory.mktemp("medium")
    write_checkpoint(model, raw, str(out), torch.bfloat16, shard_bytes=100_000_000)
    return out


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
