"""`hyserve info MODEL`: what a model is and what it costs to serve, from its config alone.

Only the config is parsed; no weight is allocated, so `hyserve info kimi-linear-48b-a3b` is instant.
Parameter counts are analytic and memory figures follow the cache layout (docs/ARCHITECTURE.md §4.8, §5).
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from hyserve.models.config import ModelConfig, load_config, parse_config
from hyserve.models.param_counts import expert_params, param_groups
from hyserve.models.presets import PRESETS, preset_config

_MIB = 1 << 20


def resolve_config(name_or_path: str) -> ModelConfig:
    if name_or_path in PRESETS:
        return parse_config(preset_config(name_or_path))
    if os.path.isdir(name_or_path) or name_or_path.endswith(".json"):
        return load_config(name_or_path)[0]
    raise SystemExit(
        f"'{name_or_path}' is neither a preset ({', '.join(sorted(PRESETS))}) nor a model directory"
    )


def model_stats(cfg: ModelConfig) -> dict[str, Any]:
    """Parameter counts, cache bytes and feature flags of `cfg` (no weights are needed)."""
    c = cfg
    n_moe = c.mlp_types.count("moe")
    groups = param_groups(c)
    embedding, lm_head = groups["embedding"], groups["lm_head"]
    total = sum(groups.values())
    active = total - groups["routed_experts"] + n_moe * c.num_experts_per_tok * expert_params(c)
    recurrent, conv = c.kda_state_bytes()
    return {
        "architecture": c.architecture,
        "num_layers": c.num_hidden_layers,
        "kda_layers": c.kda_layers,
        "mla_layers": c.mla_layers,
        "layer_pattern": run_length("".join("K" if t == "kda" else "M" for t in c.layer_types), "M"),
        "dense_layers": [i for i, t in enumerate(c.mlp_types) if t == "dense"],
        "moe_layers": [i for i, t in enumerate(c.mlp_types) if t == "moe"],
        "ffn_pattern": run_length("".join("D" if t == "dense" else "E" for t in c.mlp_types), "DE"),
        "params": groups,
        "total_params": total,
        "active_params": active,
        "active_params_without_embedding": active - embedding,
        "active_params_without_embedding_and_head": active - embedding - lm_head,
        "kv_values_per_token": len(c.mla_layers) * c.kv_row_width,
        "kv_bytes_per_token_bf16": c.kv_bytes_per_token(2),
        "kv_bytes_per_token_fp8": c.kv_bytes_per_token(1),
        "index_key_bytes_per_token": c.index_key_bytes_per_token(),
        "kda_state_bytes_recurrent": recurrent,
        "kda_state_bytes_conv": conv,
        "kda_state_bytes": recurrent + conv,
        "attn_res": bool(c.attn_res_block_size),
        "attn_res_block_size": c.attn_res_block_size,
        "latent_moe": c.latent_moe_dim is not None,
        "situ": c.hidden_act == "situ",
        "indexer": c.has_indexer,
    }


def run_length(pattern: str, enders: str) -> str:
    """Compress a layer string into repeated groups, e.g. 'KKKMKKKMKKM' -> 'KKKM×2 KKM'.

    A group runs up to and including the next character in `enders` (so MLA layers close groups)."""
    groups: list[str] = []
    cur = ""
    for ch in pattern:
        cur += ch
        if ch in enders:
            groups.append(cur)
            cur = ""
    if cur:
        groups.append(cur)
    out: list[str] = []
    i = 0
    while i < len(groups):
        j = i
        while j + 1 < len(groups) and groups[j + 1] == groups[i]:
            j += 1
        out.append(groups[i] + (f"×{j - i + 1}" if j > i else ""))
        i = j + 1
    return " ".join(out)


# ---- command line -----------------------------------------------------------------------------------


def _b(n: int) -> str:
    """Human-readable parameter count."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n:,} ({n / scale:.2f}{unit})"
    return f"{n:,}"


def _bytes(n: int) -> str:
    return f"{n:,} B" + (f" ({n / _MIB:.2f} MiB)" if n >= _MIB else "")


def format_stats(name: str, s: dict[str, Any]) -> str:
    lines = [
        f"model:             {name}",
        f"architecture:      {s['architecture']}",
        f"layers:            {s['num_layers']}  pattern {s['layer_pattern']}  (K = KDA, M = MLA)",
        f"  KDA (0-based):   {s['kda_layers']}",
        f"  MLA (0-based):   {s['mla_layers']}",
        f"ffn:               {s['ffn_pattern']}  (D = dense, E = MoE)",
        f"  dense (0-based): {s['dense_layers']}",
        f"  MoE (0-based):   {s['moe_layers']}",
        f"total params:      {_b(s['total_params'])}",
        f"active params:     {_b(s['active_params'])} per token (with embedding and lm_head)",
        f"                   {_b(s['active_params_without_embedding'])} without the embedding",
        f"                   {_b(s['active_params_without_embedding_and_head'])} without embedding and lm_head",
        f"KV cache / token:  {len(s['mla_layers'])} MLA layers x {s['kv_values_per_token'] // max(1, len(s['mla_layers']))} "
        f"= {s['kv_values_per_token']:,} values; bf16 {_bytes(s['kv_bytes_per_token_bf16'])}, "
        f"fp8 {_bytes(s['kv_bytes_per_token_fp8'])}",
    ]
    if s["indexer"]:
        lines.append(f"index keys/token:  {_bytes(s['index_key_bytes_per_token'])}")
    lines += [
        f"KDA state / seq:   {_bytes(s['kda_state_bytes'])} (recurrent {_bytes(s['kda_state_bytes_recurrent'])} "
        f"+ conv {_bytes(s['kda_state_bytes_conv'])})",
        f"features:          AttnRes={'block ' + str(s['attn_res_block_size']) if s['attn_res'] else 'off'} "
        f"LatentMoE={'on' if s['latent_moe'] else 'off'} SiTU={'on' if s['situ'] else 'off'} "
        f"DSA indexer={'on' if s['indexer'] else 'off'}",
    ]
    return "\n".join(lines)


def add_info_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("info", help="describe a model (preset or directory) from its config alone")
    p.add_argument("model", help="preset name or model directory")
    p.set_defaults(func=run_info)
    return p


def run_info(args: argparse.Namespace) -> int:
    print(format_stats(args.model, model_stats(resolve_config(args.model))))
    return 0
