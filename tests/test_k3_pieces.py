"""Kimi K3 pieces against small references written here from spec/models.md §3 (not from hyserve code),
plus K3 config parsing and the errors a bad config must name."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from hyserve.models import ConfigError, load_config, load_model, parse_config
from hyserve.models.batch import Batch, CacheTensors
from hyserve.models.layers.activation import situ_glu
from hyserve.models.layers.attn_res import AttnRes
from hyserve.models.layers.mla import MLAttention
from hyserve.models.layers.moe import MoE
from hyserve.models.loader import CheckpointError, build_model, random_init
from hyserve.models.presets import preset_config
from hyserve.ops import kda as kda_ops
from hyserve.ops import moe as moe_ops

K3_PUBLIC = Path(__file__).parent / "data" / "k3-public"
K3_TINY = parse_config(preset_config("k3-tiny"))


def randomize(module: torch.nn.Module, seed: int, std: float = 0.3) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            base = 1.0 if "norm" in name else 0.0
            p.copy_(base + torch.randn(p.shape, generator=gen) * std)
    return module.eval().requires_grad_(False)


def rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


# ---- Block AttnRes (§3.5) ---------------------------------------------------------------------------


def test_attn_res_is_a_softmax_over_sources_scored_by_rms_normalised_keys():
    gen = torch.Generator().manual_seed(0)
    d, t, eps = 16, 5, 1e-5
    mod = randomize(AttnRes(d, eps), seed=1)
    blocks = [torch.randn(t, d, generator=gen) * s for s in (1.0, 3.0)]
    prefix = torch.randn(t, d, generator=gen)
    u = mod.norm * mod.proj[0]
    want = torch.zeros(t, d)
    for i in range(t):
        srcs = [b[i] for b in blocks] + [prefix[i]]
        scores = torch.stack([(v * u).sum() / torch.sqrt((v * v).mean() + eps) for v in srcs])
        p = torch.softmax(scores, 0)
        want[i] = sum(p[s] * srcs[s] for s in range(len(srcs)))  # un-normalised sources, no 1/sqrt(D)
    assert torch.allclose(mod(blocks, prefix), want, atol=1e-6)


def test_attn_res_source_counts_follow_the_block_bookkeeping():
    layers, b = 13, 4
    raw = preset_config("k3-tiny")
    full = [4, 8, 12, 13]
    raw.update(num_hidden_layers=layers, attn_res_block_size=b)
    raw["linear_attn_config"].update(full_attn_layers=full, kda_layers=[i for i in range(1, 14) if i not in full])
    model = build_model(parse_config(raw), torch.float32, "cpu")
    random_init(model, seed=0)
    seen: list[tuple[str, int]] = []

    def recorder(tag: str, mod: AttnRes):
        def forward(blocks, prefix):
            seen.append((tag, len(blocks) + 1))
            return AttnRes.forward(mod, blocks, prefix)
        return forward

    for i, layer in enumerate(model.model.layers):
        layer.self_attention_res.forward = recorder(f"attn{i}", layer.self_attention_res)
        layer.mlp_res.forward = recorder(f"ffn{i}", layer.mlp_res)
    model.model.output_attn_res.forward = recorder("out", model.model.output_attn_res)
    model.score([5, 6, 7])

    def ceil(a: int) -> int:
        return -(-a // b)

    want = []
    for lyr in range(layers):
        if lyr > 0:  # layer 0 has no banked block yet: its self_attention_res is never used
            want.append((f"attn{lyr}", ceil(lyr) + 1))
        want.append((f"ffn{lyr}", ceil(lyr) + (lyr % b == 0) + 1))
    want.append(("out", ceil(layers) + 1))
    assert seen == want


# ---- LatentMoE + SiTU-GLU (§3.6) --------------------------------------------------------------------


def situ_reference(g: float, u: float, beta: float, lin: float | None) -> float:
    gt, ut = torch.tensor(g, dtype=torch.float64), torch.tensor(u, dtype=torch.float64)
    act = beta * torch.tanh(gt / beta) * torch.sigmoid(gt)
    lin_u = lin * torch.tanh(ut / lin) if lin is not None else ut
    return float(act * lin_u)


@pytest.mark.parametrize("g,u", [(-3.0, 2.0), (0.5, -40.0), (7.0, 0.1), (50.0, 100.0)])
def test_situ_glu_matches_its_formula(g, u):
    got = situ_glu(torch.tensor([g]), torch.tensor([u]), 4.0, 25.0)
    assert float(got) == pytest.approx(situ_reference(g, u, 4.0, 25.0), rel=1e-6)


def test_situ_sigmoid_takes_the_uncapped_gate():
    # at g = 50 the capped branch is ~beta and sigmoid(50) ~ 1; sigmoid(beta*tanh(g/beta)) would be 0.982
    got = float(situ_glu(torch.tensor([50.0]), torch.tensor([1.0]), 4.0, None))
    assert got == pytest.approx(4.0 * torch.tanh(torch.tensor(12.5)).item(), rel=1e-6)


def test_situ_without_linear_beta_leaves_up_unchanged():
    got = float(situ_glu(torch.tensor([1.0]), torch.tensor([300.0]), 4.0, None))
    assert got == pytest.approx(situ_reference(1.0, 300.0, 4.0, None), rel=1e-6)


def test_latent_moe_routes_in_the_latent_space_then_norms_and_projects_up():
    cfg = K3_TINY
    moe = randomize(MoE(cfg), seed=2)
    x = torch.randn(7, cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    act = lambda g, u: situ_glu(g, u, cfg.situ_beta, cfg.situ_linear_beta)  # noqa: E731
    inter = cfg.moe_intermediate_size
    want = torch.zeros_like(x)
    for t in range(x.shape[0]):
        s = torch.sigmoid(moe.gate.weight @ x[t])
        choice = s + moe.gate.e_score_correction_bias
        idx = sorted(range(cfg.num_experts), key=lambda e: (-float(choice[e]), e))[: cfg.num_experts_per_tok]
        w = s[idx] / (s[idx].sum() + 1e-20) * cfg.routed_scaling_factor
        x_l = moe.routed_expert_down_proj.weight @ x[t]
        y = torch.zeros(cfg.latent_moe_dim)
        for j, e in enumerate(idx):
            w1, w3 = moe.w13[e, :inter], moe.w13[e, inter:]
            y = y + w[j] * (moe.w2[e] @ act(w1 @ x_l, w3 @ x_l))
        y = moe.routed_expert_norm.weight * (y / rms(y, cfg.rms_norm_eps))
        y = moe.routed_expert_up_proj.weight @ y
        sh = moe.shared_experts
        want[t] = y + sh.down_proj.weight @ act(sh.gate_proj.weight @ x[t], sh.up_proj.weight @ x[t])
    assert torch.allclose(moe(x), want, atol=1e-5)


# ---- router tie rule (§1.6) -------------------------------------------------------------------------


def test_router_equal_scores_pick_the_lower_expert_ids():
    x = torch.randn(3, 8)
    ids, _ = moe_ops.route(x, torch.zeros(6, 8), torch.zeros(6), 3, renormalize=True, scaling=1.0)
    assert ids.tolist() == [[0, 1, 2]] * 3


def test_router_tie_between_two_best_experts_orders_them_by_id():
    bias = torch.tensor([0.0, 0.0, 0.5, 0.0, 0.0, 0.5])
    ids, w = moe_ops.route(torch.randn(2, 8), torch.zeros(6, 8), bias, 2, renormalize=True, scaling=1.0)
    assert ids.tolist() == [[2, 5], [2, 5]]
    assert torch.allclose(w, torch.full((2, 2), 0.5))  # unbiased sigmoid scores, renormalised


# ---- bounded KDA gate (§3.3) ------------------------------------------------------------------------


def test_bounded_kda_gate_is_lower_bound_times_sigmoid():
    gen = torch.Generator().manual_seed(4)
    h, k = 3, 4
    f, a_log, dt = torch.randn(6, h, k, generator=gen) * 3, torch.randn(h, generator=gen), torch.randn(h * k, generator=gen)
    got = kda_ops.kda_gate(f, a_log, dt, -5.0)
    want = -5.0 * torch.sigmoid(a_log.exp()[:, None] * (f + dt.view(h, k)))
    assert torch.allclose(got, want, atol=1e-6)
    assert bool((got > -5.0).all() and (got < 0).all())


def test_bounded_kda_gate_is_not_a_clamped_softplus_gate():
    f, a_log, dt = torch.tensor([[[2.0]]]), torch.tensor([1.0]), torch.tensor([0.5])
    bounded = kda_ops.kda_gate(f, a_log, dt, -5.0)
    softplus = kda_ops.kda_gate(f, a_log, dt, None)
    assert float(softplus) == pytest.approx(-torch.e * F.softplus(torch.tensor(2.5)).item(), rel=1e-6)
    assert not torch.allclose(bounded, softplus.clamp_min(-5.0))
    assert float(bounded) == pytest.approx(-5.0 * torch.sigmoid(torch.tensor(torch.e * 2.5)).item(), rel=1e-6)


# ---- gated MLA with q-LoRA (§3.4) -------------------------------------------------------------------


def gated_mla_reference(m: MLAttention, x: torch.Tensor) -> torch.Tensor:
    """Expanded form written from the spec: q-LoRA (eps 1e-6), NoPE, causal softmax, sigmoid output gate."""
    t, h, dn, dr, dv, r = x.shape[0], m.num_heads, m.dn, m.dr, m.dv, m.rank
    q_lat = m.q_a_layernorm.weight * (m.q_a_proj.weight @ x.T).T / rms((m.q_a_proj.weight @ x.T).T, 1e-6)
    q = (m.q_b_proj.weight @ q_lat.T).T.view(t, h, dn + dr)
    ckv = (m.kv_a_proj_with_mqa.weight @ x.T).T
    c = m.kv_a_layernorm.weight * ckv[:, :r] / rms(ckv[:, :r], 1e-6)
    k_r = ckv[:, r:]
    kv = (m.kv_b_proj.weight @ c.T).T.view(t, h, dn + dv)
    out = torch.zeros(t, h, dv)
    for i in range(t):
        for hh in range(h):
            z = torch.stack([q[i, hh, :dn] @ kv[s, hh, :dn] + q[i, hh, dn:] @ k_r[s] for s in range(i + 1)])
            p = torch.softmax(z * (dn + dr) ** -0.5, 0)
            out[i, hh] = (p[:, None] * kv[: i + 1, hh, dn:]).sum(0)
    gate = torch.sigmoid((m.g_proj.weight @ x.T).T)
    return (m.o_proj.weight @ (out.reshape(t, h * dv) * gate).T).T


def test_gated_mla_matches_the_spec_reference():
    cfg = K3_TINY
    m = randomize(MLAttention(cfg, 0), seed=5)
    x = torch.randn(9, cfg.hidden_size, generator=torch.Generator().manual_seed(6))
    cache = CacheTensors(
        pages=torch.zeros(3, 1, 4, cfg.kv_row_width), conv=torch.zeros(1, 0, 1, 3), recurrent=torch.zeros(1, 0, 1, 1, 1)
    )
    batch = Batch.build([9], [9], [[2, 0, 1]], 4, [0], [True])
    assert torch.allclose(m(x, batch, cache), gated_mla_reference(m, x), atol=1e-5)


# ---- A_log padding quirk (§3.3) ---------------------------------------------------------------------


def _k3_with_a_log_tail(tmp: Path, tail: float) -> tuple[Path, dict[str, torch.Tensor]]:
    """A copy of k3-public whose A_log tensors are stored as [2H]: the H heads, then H `tail` values."""
    h = parse_config(json.loads((K3_PUBLIC / "config.json").read_text())).kda_num_heads
    tensors = load_file(str(K3_PUBLIC / "model.safetensors"))
    heads = {}
    for k, v in list(tensors.items()):
        if k.endswith("A_log"):
            heads[k] = v.reshape(-1)[:h].clone()
            tensors[k] = torch.cat([heads[k], torch.full((h,), tail)])
    save_file(tensors, str(tmp / "model.safetensors"))
    shutil.copy(K3_PUBLIC / "config.json", tmp / "config.json")
    return tmp, heads


def _a_log_of(model, ckpt_key: str) -> torch.Tensor:
    layer = int(ckpt_key.split("layers.")[1].split(".")[0])
    return model.model.layers[layer].self_attn.A_log


def test_a_log_stored_with_zero_tail_loads_its_first_h_values(tmp_path, caplog):
    path, heads = _k3_with_a_log_tail(tmp_path, 0.0)
    with caplog.at_level(logging.WARNING):
        model = load_model(str(path), dtype="float32")
    assert not [r for r in caplog.records if "A_log" in r.getMessage()]
    for key, want in heads.items():
        assert torch.equal(_a_log_of(model, key), want)
    reference = load_model(str(K3_PUBLIC), dtype="float32")
    ids = list(range(1, 40))
    assert torch.equal(model.score(ids), reference.score(ids))


def test_a_log_with_non_zero_tail_warns_and_still_uses_first_h(tmp_path, caplog):
    path, heads = _k3_with_a_log_tail(tmp_path, 0.7)
    with caplog.at_level(logging.WARNING):
        model = load_model(str(path), dtype="float32")
    assert any("A_log" in r.getMessage() for r in caplog.records)
    for key, want in heads.items():
        assert torch.equal(_a_log_of(model, key), want)


# ---- config parsing and errors ----------------------------------------------------------------------


def k3_release_config_json(tmp: Path) -> Path:
    """The release's wrapper + text_config shape (spec §3.1) with 1-based layer lists."""
    text = preset_config("k3-mini")
    full = list(range(4, 93, 4)) + [93]
    text.update(architectures=["KimiLinearForCausalLM"], model_type="kimi_linear", num_hidden_layers=93,
                num_experts=896, attn_res_block_size=12)
    text["linear_attn_config"].update(full_attn_layers=full, kda_layers=[i for i in range(1, 94) if i not in full])
    raw = {"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3", "text_config": text}
    (tmp / "config.json").write_text(json.dumps(raw))
    return tmp


def test_k3_release_config_gives_the_release_layer_pattern(tmp_path):
    cfg, _ = load_config(str(k3_release_config_json(tmp_path)))
    assert cfg.is_k3 and cfg.num_hidden_layers == 93
    assert cfg.mla_layers == list(range(3, 92, 4)) + [92]  # 0-based: 3, 7, ..., 87, 91, 92
    assert len(cfg.kda_layers) == 69
    assert cfg.mlp_types == ["dense"] + ["moe"] * 92
    assert cfg.weight_prefix == "language_model.model." and cfg.head_prefix == "language_model."
    assert (cfg.gate_lower_bound, cfg.kda_full_rank_gate, cfg.mla_output_gate) == (-5.0, True, True)
    assert (cfg.attn_res_block_size, cfg.latent_moe_dim, cfg.hidden_act) == (12, 3584, "situ")


def test_unknown_architecture_is_named_in_the_error():
    raw = dict(preset_config("k3-tiny"), architectures=["LlamaForCausalLM"])
    with pytest.raises(ConfigError, match="LlamaForCausalLM"):
        parse_config(raw)


@pytest.mark.parametrize("field", ["hidden_size", "num_hidden_layers", "kv_lora_rank"])
def test_missing_field_is_named_in_the_error(field):
    raw = preset_config("kimi-linear-tiny")
    del raw[field]
    with pytest.raises(ConfigError, match=field):
        parse_config(raw)


def test_missing_layer_lists_are_an_error_not_a_default_pattern():
    raw = preset_config("kimi-linear-tiny")
    del raw["linear_attn_config"]["kda_layers"]
    with pytest.raises(ConfigError, match="kda_layers"):
        parse_config(raw)


def test_k3_1_directory_without_indexer_weights_fails_naming_the_indexer(tmp_path):
    # K3.1 directories load (sparse attention is served); a K3 checkpoint relabelled K3.1 lacks the
    # indexer tensors, and the error says which
    raw = json.loads((K3_PUBLIC / "config.json").read_text())
    raw["text_config"].update(index_n_heads=4, index_head_dim=16, index_topk=8)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    shutil.copy(K3_PUBLIC / "model.safetensors", tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"missing tensors.*self_attn\.indexer\."):
        load_model(str(tmp_path), dtype="float32")
