"""The parallel layout, with vLLM's names, and the check that a model can be split that way."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # EngineConfig builds a ParallelConfig in processes that never import torch (the server)
    from hyserve.models.config import ModelConfig


class ParallelConfigError(ValueError):
    """A layout the model (or the layout itself) cannot be split into; the message says what to change."""


@dataclass(frozen=True)
class ParallelConfig:
    """`tensor_parallel_size` ranks, one process each. Expert parallelism spreads the routed experts over
    the same ranks (vLLM: EP size = TP size without data parallelism). Decode context parallelism splits
    the MLA latent and DSA index keys by token inside groups of `decode_context_parallel_size`
    consecutive TP ranks; `cp_kv_cache_interleave_size` consecutive tokens go to one rank."""

    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False
    decode_context_parallel_size: int = 1
    cp_kv_cache_interleave_size: int = 1

    def __post_init__(self) -> None:
        tp, dcp = self.tensor_parallel_size, self.decode_context_parallel_size
        if tp < 1:
            raise ParallelConfigError(f"tensor_parallel_size must be at least 1, got {tp}")
        if dcp < 1:
            raise ParallelConfigError(f"decode_context_parallel_size must be at least 1, got {dcp}")
        if tp % dcp:
            raise ParallelConfigError(
                f"tensor_parallel_size ({tp}) must be divisible by decode_context_parallel_size ({dcp}): "
                "DCP groups are made of TP ranks"
            )
        if self.cp_kv_cache_interleave_size < 1:
            raise ParallelConfigError("cp_kv_cache_interleave_size must be at least 1")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size

    @property
    def expert_parallel_size(self) -> int:
        return self.tensor_parallel_size if self.enable_expert_parallel else 1


def _split_errors(cfg: ModelConfig, p: ParallelConfig) -> list[str]:
    tp, ep = p.tensor_parallel_size, p.expert_parallel_size
    need: list[tuple[str, int, int]] = []  # (what, size, parts)
    if cfg.mla_layers:
        need.append(("num_attention_heads (MLA heads)", cfg.num_attention_heads, tp))
    if cfg.kda_layers:
        need.append(("KDA num_heads", cfg.kda_num_heads, tp))
    if "dense" in cfg.mlp_types:
        need.append(("intermediate_size (dense MLP)", cfg.intermediate_size, tp))
    if "moe" in cfg.mlp_types:
        if ep > 1:
            need.append(("num_experts", cfg.num_experts, ep))
        else:
            need.append(("moe_intermediate_size (routed experts)", cfg.moe_intermediate_size, tp))
            if cfg.num_shared_experts:
                need.append(("shared experts' width", cfg.moe_intermediate_size * cfg.num_shared_experts, tp))
            if cfg.latent_moe_dim is not None:
                need.append(("hidden_size (LatentMoE up-projection columns)", cfg.hidden_size, tp))
    return [f"{what} = {size} is not divisible by {parts}" for what, size, parts in need if size % parts]


def check_model_splits(cfg: ModelConfig, p: ParallelConfig) -> None:
    """Raise ParallelConfigError naming every dimension of `cfg` the layout cannot split evenly."""
    errors = _split_errors(cfg, p)
    if p.decode_context_parallel_size > 1:
        if not cfg.mla_layers:
            errors.append("decode context parallelism splits the MLA cache, and this model has no MLA layer")
        if cfg.has_indexer and p.cp_kv_cache_interleave_size != 1:
            errors.append("a DSA indexer under DCP needs cp_kv_cache_interleave_size = 1")
    if errors:
        layout = (f"tensor_parallel_size={p.tensor_parallel_size}, enable_expert_parallel={p.enable_expert_parallel}, "
                  f"decode_context_parallel_size={p.decode_context_parallel_size}")
        raise ParallelConfigError(f"this model cannot be split with {layout}: " + "; ".join(errors))
