"""A medium sharded bf16 checkpoint for the loader's memory tests (CPU and CUDA)."""

from __future__ import annotations

from pathlib import Path

import torch

from hyserve.models.checkpoint_writer import write_checkpoint
from hyserve.models.config import parse_config
from hyserve.models.loader import build_model, random_init
from hyserve.models.presets import preset_config

# about 340 MB of bf16 weights in 4 shards of at most 100 MB (the largest tensor, lm_head, is 67 MB)
MEDIUM = dict(vocab_size=32768, hidden_size=1024, intermediate_size=2048, num_experts=16, moe_intermediate_size=512,
              num_attention_heads=8, num_key_value_heads=8, kv_lora_rank=256, qk_nope_head_dim=64,
              qk_rope_head_dim=32, v_head_dim=64, dtype="bfloat16",
              linear_attn_config={"num_heads": 8, "head_dim": 128, "short_conv_kernel_size": 4,
                                  "kda_layers": [1, 2, 3], "full_attn_layers": [4]})


def write_medium_checkpoint(out: Path) -> Path:
    raw = dict(preset_config("kimi-linear-tiny"), **MEDIUM)
    model = build_model(parse_config(raw), torch.bfloat16, "cpu")
    random_init(model, seed=0)
    write_checkpoint(model, raw, str(out), torch.bfloat16, shard_bytes=100_000_000)
    return out
