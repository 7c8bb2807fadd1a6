"""Parameter counts of a model from its config alone (no weights): per layer kind and per group, what
`hyserve info` prints and what the step cost model (hyserve/planning/step_cost.py) reads."""

from __future__ import annotations

from hyserve.models.config import ModelConfig


def kda_layer_params(c: ModelConfig) -> int:
    d, h, k, p, w = c.hidden_size, c.kda_num_heads, c.kda_head_dim, c.kda_proj_dim, c.conv_kernel_size
    gate = p * d if c.kda_full_rank_gate else k * d + p * k
    # q/k/v proj, conv taps, f_a/f_b, dt_bias, A_log (per head), b_proj, output gate, o_norm, o_proj
    return 3 * p * d + 3 * p * w + (k * d + p * k) + p + h + h * d + gate + k + d * p


def mla_layer_params(c: ModelConfig) -> int:
    d, n, r = c.hidden_size, c.num_attention_heads, c.kv_lora_rank
    if c.q_lora_rank:
        q = c.q_lora_rank * d + c.q_lora_rank + n * c.qk_head_dim * c.q_lora_rank
    else:
        q = n * c.qk_head_dim * d
    kv = (r + c.qk_rope_head_dim) * d + r + n * (c.qk_nope_head_dim + c.v_head_dim) * r
    gate = n * c.v_head_dim * d if c.mla_output_gate else 0
    return q + kv + gate + d * n * c.v_head_dim


def indexer_layer_params(c: ModelConfig) -> int:
    if not c.has_indexer:
        return 0
    hi, di, d = c.index_n_heads, c.index_head_dim, c.hidden_size
    return hi * di * (c.q_lora_rank or 0) + di * d + 2 * di + hi * d


def expert_params(c: ModelConfig) -> int:
    """One routed expert: w1, w3 [I, D_e] and w2 [D_e, I], D_e the latent width under LatentMoE."""
    return 3 * c.moe_intermediate_size * (c.latent_moe_dim or c.hidden_size)


def moe_layer_params_without_routed(c: ModelConfig) -> int:
    d, e = c.hidden_size, c.num_experts
    router = e * d + e  # gate.weight + e_score_correction_bias
    latent = 0
    if c.latent_moe_dim:
        latent = 2 * d * c.latent_moe_dim + (c.latent_moe_dim if c.latent_moe_norm else 0)
    shared = 3 * d * c.moe_intermediate_size * c.num_shared_experts
    return router + latent + shared


def param_groups(c: ModelConfig) -> dict[str, int]:
    """Parameters per group: kda, mla, indexer, dense_ffn, routed_experts, moe_other, attn_res, norms,
    embedding, lm_head."""
    n_kda, n_mla = len(c.kda_layers), len(c.mla_layers)
    n_moe = c.mlp_types.count("moe")
    n_dense = c.mlp_types.count("dense")
    d, n_layers = c.hidden_size, c.num_hidden_layers
    embedding = lm_head = c.vocab_size * d
    return {
        "kda": n_kda * kda_layer_params(c),
        "mla": n_mla * mla_layer_params(c),
        "indexer": n_mla * indexer_layer_params(c),
        "dense_ffn": n_dense * 3 * d * c.intermediate_size,
        "routed_experts": n_moe * c.num_experts * expert_params(c),
        "moe_other": n_moe * moe_layer_params_without_routed(c),
        # per layer (AttnRes proj + norm) x 2, plus the output mix
        "attn_res": (n_layers * 4 * d + 2 * d) if c.attn_res_block_size else 0,
        "norms": n_layers * 2 * d + d,
        "embedding": embedding,
        "lm_head": lm_head,
    }
