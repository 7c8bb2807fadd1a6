"""Random-weight presets (docs/ARCHITECTURE.md §4.7): config.json dicts in the formats real checkpoints use."""

from __future__ import annotations

import copy

# Kimi Linear 48B-A3B, the public checkpoint's shape (remote-code spelling, 1-based layer lists).
_KIMI_LINEAR_48B = {
    "architectures": ["KimiLinearForCausalLM"],
    "model_type": "kimi_linear",
    "vocab_size": 163840,
    "hidden_size": 2304,
    "num_hidden_layers": 27,
    "intermediate_size": 9216,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "q_lora_rank": None,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "mla_use_nope": True,
    "linear_attn_config": {
        "num_heads": 32,
        "head_dim": 128,
        "short_conv_kernel_size": 4,
        "kda_layers": [i for i in range(1, 28) if i not in (4, 8, 12, 16, 20, 24, 27)],
        "full_attn_layers": [4, 8, 12, 16, 20, 24, 27],
    },
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "num_experts": 256,
    "num_experts_per_token": 8,
    "num_shared_experts": 1,
    "moe_intermediate_size": 1024,
    "moe_router_activation_func": "sigmoid",
    "moe_renormalize": True,
    "routed_scaling_factor": 2.446,
    "use_grouped_topk": True,
    "num_expert_group": 1,
    "topk_group": 1,
    "model_max_length": 1048576,
    "bos_token_id": 163584,
    "eos_token_id": 163586,
    "pad_token_id": 163839,
    "dtype": "bfloat16",
}


def _k3(
    *, vocab: int, hidden: int, layers: int, heads: int, kda_heads: int, head_dim: int, q_lora: int,
    kv_lora: int, nope: int, rope: int, v: int, inter: int, experts: int, topk: int, shared: int,
    moe_inter: int, latent: int, block: int, full_attn: list[int], max_len: int,
    bos: int, eos: int, pad: int,
) -> dict:
    return {
        "architectures": ["KimiK3ForCausalLM"],
        "model_type": "kimi_k3",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "intermediate_size": inter,
        "q_lora_rank": q_lora,
        "kv_lora_rank": kv_lora,
        "qk_nope_head_dim": nope,
        "qk_rope_head_dim": rope,
        "v_head_dim": v,
        "mla_use_nope": True,
        "mla_use_output_gate": True,
        "linear_attn_config": {
            "full_attn_layers": full_attn,
            "kda_layers": [i for i in range(1, layers + 1) if i not in full_attn],
            "head_dim": head_dim,
            "num_heads": kda_heads,
            "short_conv_kernel_size": 4,
            "gate_lower_bound": -5.0,
            "use_full_rank_gate": True,
        },
        "attn_res_block_size": block,
        "num_experts": experts,
        "num_experts_per_token": topk,
        "num_shared_experts": shared,
        "moe_intermediate_size": moe_inter,
        "routed_expert_hidden_size": latent,
        "latent_moe_use_norm": True,
        "moe_layer_freq": 1,
        "first_k_dense_replace": 1,
        "moe_router_activation_func": "sigmoid",
        "moe_renormalize": True,
        "routed_scaling_factor": 1.0,
        "use_grouped_topk": True,
        "num_expert_group": 1,
        "topk_group": 1,
        "hidden_act": "situ",
        "activation_situ_beta": 4.0,
        "activation_situ_linear_beta": 25.0,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": max_len,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": pad,
        "dtype": "bfloat16",
    }


# Byte-tokenizer presets (vocab 512: 256 bytes + specials; see hyserve/tokenizer.py).
_K3_TINY = _k3(
    vocab=512, hidden=64, layers=6, heads=4, kda_heads=4, head_dim=16, q_lora=32, kv_lora=32, nope=16,
    rope=8, v=16, inter=128, experts=8, topk=2, shared=1, moe_inter=32, latent=32, block=2,
    full_attn=[4, 6], max_len=4096, bos=256, eos=258, pad=511,
)
_K3_MINI = _k3(
    vocab=163840, hidden=7168, layers=8, heads=96, kda_heads=96, head_dim=128, q_lora=1536, kv_lora=512,
    nope=128, rope=64, v=128, inter=33792, experts=64, topk=16, shared=2, moe_inter=3072, latent=3584,
    block=4, full_attn=[4, 8], max_len=1048576, bos=163584, eos=163586, pad=163839,
)
_K3_1_MINI = dict(_K3_MINI, index_n_heads=32, index_head_dim=128, index_topk=2048)
# k3-tiny + a small indexer; top-8 makes the selection really sparse on prompts of a few dozen tokens
_K3_1_TINY = dict(_K3_TINY, index_n_heads=4, index_head_dim=16, index_topk=8)

_KIMI_LINEAR_TINY = dict(
    copy.deepcopy(_KIMI_LINEAR_48B),
    vocab_size=512, hidden_size=64, num_hidden_layers=4, intermediate_size=128, num_attention_heads=4,
    num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
    num_experts=8, num_experts_per_token=2, moe_intermediate_size=32, routed_scaling_factor=2.446,
    model_max_length=4096, bos_token_id=256, eos_token_id=258, pad_token_id=511, dtype="float32",
    linear_attn_config={"num_heads": 4, "head_dim": 16, "short_conv_kernel_size": 4,
                        "kda_layers": [1, 2, 3], "full_attn_layers": [4]},
)
_K3_TINY["dtype"] = "float32"
_K3_1_TINY["dtype"] = "float32"

PRESETS: dict[str, dict] = {
    "k3-tiny": _K3_TINY,
    "kimi-linear-tiny": _KIMI_LINEAR_TINY,
    "kimi-linear-48b-a3b": _KIMI_LINEAR_48B,
    "k3-mini": _K3_MINI,
    "k3.1-tiny": _K3_1_TINY,
    "k3.1-mini": _K3_1_MINI,
}


def preset_config(name: str) -> dict:
    if name not in PRESETS:
        raise KeyError(f"unknown preset '{name}'; presets: {', '.join(sorted(PRESETS))}")
    return copy.deepcopy(PRESETS[name])
