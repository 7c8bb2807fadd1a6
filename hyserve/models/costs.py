"""Prefill FLOPs of a token prefix from the model's real per-layer shapes (Marconi).

The prefix cache's checkpoint eviction (engine/checkpoints.py) ranks a checkpoint by the compute it saves per byte it holds. The absolute scale does
not matter (scores are min-max normalized), but the *shape* does: linear layers cost the same per token,
while MLA (and the DSA indexer) cost grows with the context, so a deep checkpoint saves superlinearly more
than a shallow one. Counting 2 FLOPs per multiply-add.
"""

from __future__ import annotations

from dataclasses import dataclass

from hyserve.models.config import ModelConfig


@dataclass(frozen=True)
class PrefillCost:
    per_token: float  # FLOPs per token that do not depend on the context length
    per_token_context: float  # FLOPs per token per context token (attention)

    def flops(self, n: int) -> float:
        """FLOPs to prefill tokens 0..n-1 from scratch (token i attends to i+1 positions)."""
        return self.per_token * n + self.per_token_context * n * (n + 1) / 2

    def saved(self, start: int, end: int) -> float:
        """FLOPs a hit at `end` saves over resuming at `start`."""
        return self.flops(end) - self.flops(start)


def _kda_layer(c: ModelConfig) -> float:
    d, h, k = c.hidden_size, c.kda_num_heads, c.kda_head_dim
    p = h * k
    proj = 3 * d * p + d * k + k * p + d * h + p * d  # q, k, v, decay (low rank), beta, o_proj
    gate = d * p if c.kda_full_rank_gate else d * k + k * p
    conv = 3 * p * c.conv_kernel_size
    # chunked delta rule: state read-out, the rank-1 correction and the decayed update per head
    recurrence = 3 * h * k * k
    return 2.0 * (proj + gate + conv + recurrence)


def _mla_layer(c: ModelConfig) -> tuple[float, float]:
    d, h = c.hidden_size, c.num_attention_heads
    q = d * c.q_lora_rank + c.q_lora_rank * h * c.qk_head_dim if c.q_lora_rank else d * h * c.qk_head_dim
    kv = d * (c.kv_lora_rank + c.qk_rope_head_dim) + c.kv_lora_rank * h * (c.qk_nope_head_dim + c.v_head_dim)
    out = h * c.v_head_dim * d + (d * h * c.v_head_dim if c.mla_output_gate else 0)
    per_ctx = h * (c.qk_head_dim + c.v_head_dim)  # scores + weighted values
    if c.has_indexer:  # DSA indexer scores every earlier token: O(L^2) even though attention is top-k
        per_ctx += c.index_n_heads * c.index_head_dim
    return 2.0 * (q + kv + out), 2.0 * per_ctx


def _mlp_layer(c: ModelConfig, kind: str) -> float:
    d = c.hidden_size
    if kind == "dense":
        return 2.0 * 3 * d * c.intermediate_size
    e = c.latent_moe_dim or d
    latent = 2 * d * e if c.latent_moe_dim else 0
    experts = 3 * e * c.moe_intermediate_size * c.num_experts_per_tok
    shared = 3 * d * c.moe_intermediate_size * c.num_shared_experts
    return 2.0 * (d * c.num_experts + latent + experts + shared)


def prefill_cost(c: ModelConfig) -> PrefillCost:
    per_token, per_ctx = 0.0, 0.0
    for kind, mlp in zip(c.layer_types, c.mlp_types):
        if kind == "kda":
            per_token += _kda_layer(c)
        else:
            lin, ctx = _mla_layer(c)
            per_token, per_ctx = per_token + lin, per_ctx + ctx
        per_token += _mlp_layer(c, mlp)
    return PrefillCost(per_token, per_ctx)
