"""Cache and execution flags shared by `hyserve serve` and `hyserve generate`, and their mapping onto
`EngineConfig` fields (DESIGN.md §8). A flag left out maps to nothing, so the EngineConfig default
(and, for the retention interval, env HYSERVE_PREFIX_CACHE_RETENTION_INTERVAL) still applies."""

from __future__ import annotations

import argparse
from typing import Any

from hyserve.config import LOAD_FORMATS

GIB = 1 << 30


def add_cache_arguments(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    p.add_argument("--load-format", choices=LOAD_FORMATS, default=None,
                   help="how to read the weights: safetensors (streamed tensor by tensor), fastsafetensors "
                        "(needs `pip install fastsafetensors`), dummy (random weights at the config's shape); "
                        "default auto: safetensors for a directory, dummy for a preset")
    p.add_argument("--prefix-cache-retention-interval", type=int, default=None, metavar="N",
                   help="also keep a prefix-cache checkpoint every N tokens; 0 = off "
                        "(default: env HYSERVE_PREFIX_CACHE_RETENTION_INTERVAL, else 0)")
    p.add_argument("--kv-offloading-size", type=float, default=None, metavar="GIB",
                   help="CPU tier of the prefix cache, in GiB; 0 = off (default: 0)")
    p.add_argument("--num-gpu-blocks-override", type=int, default=None, metavar="N",
                   help="KV cache pages to allocate, instead of sizing the pool from memory")
    p.add_argument("--num-checkpoint-slots", type=int, default=None, metavar="N",
                   help="state slots reserved for prefix-cache checkpoints (default: sized by the engine)")
    p.add_argument("--enforce-eager", action="store_true", default=None,
                   help="never capture CUDA graphs: decode steps run eagerly (default on CUDA: graphs for "
                        "decode batches up to min(max-num-seqs, 512))")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="launch each step before reading back the previous one's tokens, so host work "
                        "overlaps the GPU (a request that stops computes one token more, which is dropped); "
                        "default: on for CUDA devices")


def cache_config_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """EngineConfig keyword arguments for the flags of `add_cache_arguments` that were given."""
    out: dict[str, Any] = {}
    if getattr(args, "prefix_cache_retention_interval", None) is not None:
        out["prefix_cache_retention_interval"] = args.prefix_cache_retention_interval
    size = getattr(args, "kv_offloading_size", None)
    if size is not None:
        if size < 0:
            raise ValueError(f"--kv-offloading-size must be >= 0 GiB, got {size}")
        out["cpu_offload_bytes"] = int(size * GIB)
    # (flag, EngineConfig field, smallest value): a pool needs a page; checkpoints may be switched off.
    for flag, field, least in (("num_gpu_blocks_override", "num_gpu_blocks", 1),
                               ("num_checkpoint_slots", "num_checkpoint_slots", 0)):
        value = getattr(args, flag, None)
        if value is not None:
            if value < least:
                raise ValueError(f"--{flag.replace('_', '-')} must be >= {least}, got {value}")
            out[field] = value
    if getattr(args, "enforce_eager", None):
        out["enforce_eager"] = True
    if getattr(args, "load_format", None) is not None:
        out["load_format"] = args.load_format
    if getattr(args, "async_scheduling", None) is not None:
        out["async_scheduling"] = args.async_scheduling
    return out
