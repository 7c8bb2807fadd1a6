"""`hyserve info`: analytic parameter counts and cache sizes against spec/models.md §2.7, §3.7, §4.2, §6."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from hyserve.entrypoints.info import add_info_parser, model_stats, run_info, run_length
from hyserve.models import load_model, parse_config
from hyserve.models.presets import preset_config

K3_PUBLIC = Path(__file__).parent / "data" / "k3-public"


def k3_release_config(**extra) -> dict:
    """The K3 release's text_config (spec §3.1), built from the k3-mini preset's per-layer shapes."""
    text = preset_config("k3-mini")
    full = list(range(4, 93, 4)) + [93]
    text.update(
        architectures=["KimiLinearForCausalLM"], model_type="kimi_linear", num_hidden_layers=93,
        num_experts=896, attn_res_block_size=12, **extra,
    )
    text["linear_attn_config"].update(
        full_attn_layers=full, kda_layers=[i for i in range(1, 94) if i not in full]
    )
    return {"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3", "text_config": text}


@pytest.fixture(scope="module")
def kimi_linear_48b() -> dict:
    return model_stats(parse_config(preset_config("kimi-linear-48b-a3b")))


def test_kimi_linear_48b_total_parameters(kimi_linear_48b):
    assert kimi_linear_48b["total_params"] == 49_122_681_728


def test_kimi_linear_48b_active_parameters(kimi_linear_48b):
    assert kimi_linear_48b["active_params"] == 3_484_459_904
    assert kimi_linear_48b["active_params_without_embedding"] == 3_106_972_544
    assert kimi_linear_48b["active_params_without_embedding_and_head"] == 2_729_485_184


def test_kimi_linear_48b_parameter_groups(kimi_linear_48b):
    p = kimi_linear_48b["params"]
    assert p["kda"] == 790_285_440
    assert p["mla"] == 203_804_160
    assert p["dense_ffn"] == 63_700_992
    assert p["routed_experts"] == 47_110_422_528
    assert p["norms"] == 126_720


def test_kimi_linear_48b_kv_cache_bytes(kimi_linear_48b):
    assert kimi_linear_48b["kv_values_per_token"] == 7 * 576
    assert kimi_linear_48b["kv_bytes_per_token_bf16"] == 8_064
    assert kimi_linear_48b["kv_bytes_per_token_fp8"] == 4_032
    assert kimi_linear_48b["index_key_bytes_per_token"] == 0


def test_kimi_linear_48b_kda_state_bytes(kimi_linear_48b):
    assert kimi_linear_48b["kda_state_bytes_recurrent"] == 41_943_040
    assert kimi_linear_48b["kda_state_bytes_conv"] == 1_474_560
    assert kimi_linear_48b["kda_state_bytes"] == 43_417_600


def test_kimi_linear_48b_patterns(kimi_linear_48b):
    assert kimi_linear_48b["layer_pattern"] == "KKKM×6 KKM"
    assert kimi_linear_48b["mla_layers"] == [3, 7, 11, 15, 19, 23, 26]
    assert kimi_linear_48b["ffn_pattern"] == "D E×26"
    assert kimi_linear_48b["dense_layers"] == [0]


def test_k3_release_counts():
    s = model_stats(parse_config(k3_release_config()))
    assert s["total_params"] == 2_779_484_476_000
    assert s["active_params"] == 105_364_017_760
    assert s["active_params_without_embedding"] == 104_189_612_640
    assert s["layer_pattern"] == "KKKM×23 M"
    assert s["kv_bytes_per_token_fp8"] == 13_824
    assert s["kda_state_bytes"] == 449_372_160
    assert s["attn_res"] and s["latent_moe"] and s["situ"] and not s["indexer"]


def test_k3_1_adds_indexer_parameters_and_index_key_bytes():
    s = model_stats(parse_config(k3_release_config(index_n_heads=32, index_head_dim=128, index_topk=2048)))
    assert s["params"]["indexer"] == 178_526_208
    assert s["total_params"] == 2_779_663_002_208
    assert s["active_params"] == 105_542_543_968
    assert s["index_key_bytes_per_token"] == 24 * 132


@pytest.mark.parametrize("name", ["k3-tiny", "kimi-linear-tiny"])
def test_analytic_total_equals_the_built_models_parameter_count(name):
    model = load_model(name, dtype="float32")
    assert model_stats(model.config)["total_params"] == sum(p.numel() for p in model.parameters())


def test_analytic_total_counts_a_padded_a_log_at_the_head_count():
    model = load_model(str(K3_PUBLIC), dtype="float32")
    assert model_stats(model.config)["total_params"] == sum(p.numel() for p in model.parameters())


def test_run_length_groups_layers_ending_at_mla():
    assert run_length("KKKMKKKMKKM", "M") == "KKKM×2 KKM"
    assert run_length("KKKMKM", "M") == "KKKM KM"
    assert run_length("KKK", "M") == "KKK"


def test_info_command_prints_the_summary_without_loading_weights(capsys):
    parser = argparse.ArgumentParser()
    add_info_parser(parser.add_subparsers())
    args = parser.parse_args(["info", "kimi-linear-48b-a3b"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "KimiLinearForCausalLM" in out
    assert "KKKM×6 KKM" in out
    assert "49,122,681,728" in out
    assert "8,064 B" in out
    assert "43,417,600 B" in out


def test_info_command_reads_a_model_directory(capsys):
    assert run_info(argparse.Namespace(model=str(K3_PUBLIC))) == 0
    out = capsys.readouterr().out
    assert "KimiK3ForCausalLM" in out and "AttnRes=block 2" in out
