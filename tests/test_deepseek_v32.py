"""DeepSeek V3.2 (spec/models.md §5) against transformers' `DeepseekV32ForCausalLM`, a test-only oracle.

transformers' eager path scores the indexer unquantised in fp32 (no Hadamard, no FP8: spec §5.3 notes
both omissions) and takes `topk(min(index_topk, T))` over causally masked scores, then masks every
unselected key. That is hyserve's R0 path (`index_key_format="raw"`), so the two must agree to float32
rounding; prompts both shorter and longer than index_topk make the selection really sparse. Random
weights are large enough (std 0.15) that a wrong rope permutation, YaRN ramp or softmax scale shows.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from dsa_util import run_steps
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")
from transformers import DeepseekV32Config, DeepseekV32ForCausalLM  # noqa: E402

from hyserve.models import load_model  # noqa: E402
from hyserve.models.batch import Batch  # noqa: E402
from hyserve.models.config import parse_config  # noqa: E402
from hyserve.models.deepseek_v32 import dequant_fp8_blocks  # noqa: E402

REL_TOL = 1e-4
TOPK = 6
HF_CONFIG = dict(
    vocab_size=97, hidden_size=48, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=3,
    num_attention_heads=3, num_key_value_heads=3, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
    n_group=4, topk_group=2, routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
    qk_nope_head_dim=12, v_head_dim=10, index_n_heads=16, index_head_dim=16, index_topk=TOPK,
    first_k_dense_replace=1, max_position_embeddings=64, pad_token_id=0,
    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
                     "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
)


def _randomize(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if "inv_freq" in name:
                continue
            if name.endswith("e_score_correction_bias"):
                t.copy_(torch.randn(t.shape, generator=gen) * 0.05)
            elif "norm" in name:
                t.copy_(1 + 0.2 * torch.randn(t.shape, generator=gen))
            elif t.dim() >= 2:
                t.copy_(torch.randn(t.shape, generator=gen) * 0.15)


@pytest.fixture(scope="module")
def hf(tmp_path_factory) -> tuple[DeepseekV32ForCausalLM, Path]:
    cfg = DeepseekV32Config(**HF_CONFIG)
    cfg._attn_implementation = "eager"
    model = DeepseekV32ForCausalLM(cfg).eval()
    _randomize(model, 1)
    path = tmp_path_factory.mktemp("dsv32")
    model.save_pretrained(path)
    return model, path


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    return torch.randint(1, 97, (30,), generator=torch.Generator().manual_seed(2)).tolist()


def _hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def test_logits_match_transformers_with_short_and_long_contexts(hf, prompt):
    model, path = hf
    ours = load_model(str(path), dtype="float32", index_key_format="raw")
    for n in (TOPK - 1, len(prompt)):  # dense-equivalent, then really sparse
        ids = prompt[:n]
        assert _rel(ours.score(ids, block_size=8), _hf_logits(model, ids)) < REL_TOL


def test_chunked_prefill_and_decode_match_transformers(hf, prompt):
    model, path = hf
    ours = load_model(str(path), dtype="float32", index_key_format="raw")
    ref = _hf_logits(model, prompt)
    (chunked,) = run_steps(ours, [prompt], [[4, 9, 1, 16]])
    (decode,) = run_steps(ours, [prompt], [[10] + [1] * 20])
    assert _rel(chunked, ref) < REL_TOL and _rel(decode, ref) < REL_TOL


def test_the_indexer_really_selects(hf, prompt):
    """Guard against a vacuous parity: with top-k covering the prompt the logits change."""
    model, _ = hf
    sparse = _hf_logits(model, prompt)
    for layer in model.model.layers:
        layer.self_attn.indexer.index_topk = 10**6
    try:
        dense = _hf_logits(model, prompt)
    finally:
        for layer in model.model.layers:
            layer.self_attn.indexer.index_topk = TOPK
    assert _rel(sparse[:TOPK], dense[:TOPK]) < REL_TOL
    assert _rel(sparse, dense) > 1e-2


def _first_layer_selection(model, ids: list[int]) -> torch.Tensor:
    """Layer 0's index sets for a one-pass prefill (its inputs do not depend on earlier selections)."""
    n = len(ids)
    blocks = -(-n // 8)
    cache = model.make_cache(blocks, 8, 1)
    batch = Batch.build([n], [n], [list(range(blocks))], 8, [0], [True])
    layer = model.model.layers[0]
    attn = layer.self_attn
    x = layer.input_layernorm(model.model.embed_tokens(torch.tensor(ids)))
    q_lat = attn.q_a_layernorm(attn.q_a_proj(x))
    return attn.indexer(x, q_lat, batch, cache, attn.rotary.cos_sin(batch.positions))


@torch.inference_mode()
def test_fp8_index_path_selects_nearly_the_exact_sets(hf, prompt):
    """R1 (Hadamard, ue8m0 FP8 keys and queries) vs R0 is a quality check, not an equality (spec §4.6)."""
    _, path = hf
    r0 = load_model(str(path), dtype="float32", index_key_format="raw")
    r1 = load_model(str(path), dtype="float32")
    assert r1.make_cache(1, 8, 1).index_keys.shape[-1] == 16 + 4
    a, b = _first_layer_selection(r0, prompt), _first_layer_selection(r1, prompt)
    overlap = [len(set(a[t].tolist()) & set(b[t].tolist())) / TOPK for t in range(TOPK, len(prompt))]
    assert sum(overlap) / len(overlap) > 0.85
    assert torch.equal(a[:TOPK].sort(-1).values, b[:TOPK].sort(-1).values)  # all of 0..t while t < top-k


# ---- FP8 block-quantised checkpoints (spec §5.5) -----------------------------------------------------------

_FP8_LINEARS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "indexer.wq_b", "indexer.wk",
                "gate_proj", "up_proj", "down_proj")
BLOCK = (16, 8)  # not square and not dividing every shape, so partial tiles are exercised


def _quantize_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    out, inp = w.shape
    so, si = -(-out // BLOCK[0]), -(-inp // BLOCK[1])
    pad = torch.zeros(so * BLOCK[0], si * BLOCK[1])
    pad[:out, :inp] = w
    amax = pad.view(so, BLOCK[0], si, BLOCK[1]).abs().amax((1, 3)).clamp_min(1e-8)
    scale = amax / 448
    s = scale.repeat_interleave(BLOCK[0], 0)[:out].repeat_interleave(BLOCK[1], 1)[:, :inp]
    return (w / s).to(torch.float8_e4m3fn), scale


def test_fp8_checkpoint_is_dequantised_at_load(hf, prompt, tmp_path):
    _, path = hf
    tensors = load_file(str(path / "model.safetensors"))
    fp8, deq = {}, {}
    for name, t in tensors.items():
        if name.endswith(".weight") and any(f".{p}.weight" in name for p in _FP8_LINEARS):
            w8, scale = _quantize_blocks(t)
            fp8[name], fp8[name + "_scale_inv"] = w8, scale
            deq[name] = w8.float() * scale.repeat_interleave(BLOCK[0], 0)[: t.shape[0]].repeat_interleave(
                BLOCK[1], 1)[:, : t.shape[1]]
        else:
            fp8[name] = deq[name] = t
    # the MTP layer (index num_hidden_layers) of the public checkpoint must be skipped
    fp8["model.layers.3.eh_proj.weight"] = torch.zeros(4, 4)
    config = json.loads((path / "config.json").read_text())
    for d, state, quant in ((tmp_path / "fp8", fp8, True), (tmp_path / "deq", deq, False)):
        d.mkdir()
        cfg = dict(config, quantization_config={"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                                "weight_block_size": list(BLOCK)}) if quant else config
        (d / "config.json").write_text(json.dumps(cfg))
        save_file(state, str(d / "model.safetensors"))
    a = load_model(str(tmp_path / "fp8"), dtype="float32", index_key_format="raw")
    b = load_model(str(tmp_path / "deq"), dtype="float32", index_key_format="raw")
    name = "model.layers.1.self_attn.o_proj.weight"
    assert torch.equal(dict(a.named_parameters())[name], deq[name])
    assert torch.equal(a.score(prompt[:12], 8), b.score(prompt[:12], 8))


def test_block_dequantisation_multiplies_by_the_scale():
    w8 = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]).to(torch.float8_e4m3fn)
    scale = torch.tensor([[2.0, 10.0]])
    got = dequant_fp8_blocks(w8, scale, (2, 2))
    assert got.tolist() == [[2.0, 4.0, 30.0], [8.0, 10.0, 60.0]]


# ---- config (spec §5.1, §5.2) ------------------------------------------------------------------------------


def test_release_config_parses_with_the_mscale_softmax_scale():
    raw = {
        "architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32", "vocab_size": 129280,
        "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
        "num_nextn_predict_layers": 1, "num_attention_heads": 128, "num_key_value_heads": 128,
        "n_shared_experts": 1, "n_routed_experts": 256, "routed_scaling_factor": 2.5, "kv_lora_rank": 512,
        "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
        "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
        "norm_topk_prob": True, "scoring_func": "sigmoid", "hidden_act": "silu", "max_position_embeddings": 163840,
        "rms_norm_eps": 1e-6, "rope_theta": 10000, "index_topk": 2048, "index_head_dim": 128, "index_n_heads": 64,
        "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "original_max_position_embeddings": 4096, "type": "yarn"},
        "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                "weight_block_size": [128, 128]},
        "bos_token_id": 0, "eos_token_id": 1, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    }
    cfg = parse_config(raw)
    assert cfg.is_deepseek_v32 and cfg.layer_types == ["mla"] * 61
    assert cfg.mlp_types[:4] == ["dense", "dense", "dense", "moe"]
    assert (cfg.num_experts, cfg.num_expert_group, cfg.topk_group, cfg.index_n_heads) == (256, 8, 4, 64)
    assert cfg.attn_softmax_scale == pytest.approx(0.1352338, abs=5e-8)
    assert cfg.index_key_bytes_per_token() == 61 * 132
    assert cfg.weight_block_size == [128, 128]
    # YaRN ramp of spec §5.2: low 10, high 23, theta' = theta / 40 above the ramp
    from hyserve.models.layers.rope import rope_inv_freq

    inv, attn_factor = rope_inv_freq(64, 10000.0, cfg.rope_scaling, 163840)
    base = 10000.0 ** (-torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    ramp = ((torch.arange(32, dtype=torch.float64) - 10) / 13).clamp(0, 1)
    torch.testing.assert_close(inv.double(), base / 40 * ramp + base * (1 - ramp), rtol=1e-6, atol=0)
    assert attn_factor == 1.0
    assert math.isclose(0.1 * math.log(40) + 1, 1.368888, abs_tol=1e-6)
