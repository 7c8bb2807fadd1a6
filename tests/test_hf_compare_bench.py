"""benchmarks/hf_compare.py's pairing of a transformers model and a hyserve model on the same weights,
checked on the CPU with its tiny config (transformers' PyTorch fallbacks, float32)."""

from __future__ import annotations

import pytest
import torch
from bench_util import load_benchmark

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("hf_compare")  # its sibling modules (gpu_common, gpu_decode) import without CUDA


@pytest.fixture(scope="module")
def tiny_preset(bench):
    from hyserve.models.presets import preset_config

    return {**preset_config("kimi-linear-48b-a3b"), **bench.TINY}


def test_the_cut_keeps_the_full_models_layer_kinds(bench):
    from hyserve.models.presets import preset_config

    cfg = bench.hf_config(preset_config("kimi-linear-48b-a3b"), 9)
    assert cfg.layer_types == ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + [
        "full_attention", "linear_attention"]
    assert cfg.mlp_layer_types == ["dense"] + ["sparse"] * 8
    assert (cfg.hidden_size, cfg.num_local_experts, cfg.moe_intermediate_size) == (2304, 256, 1024)


def test_both_models_hold_the_same_weights_and_give_the_same_logits(bench, tiny_preset):
    hf, ours = bench.build_pair(tiny_preset, 4, "cpu", torch.float32)
    ids = torch.randint(3, ours.config.vocab_size, (40,), generator=torch.Generator().manual_seed(0))
    got = bench.prefill_step_fn(ours, ids)()
    want = bench.hf_prefill_fn(hf, ids)()
    assert bench.rel_err(got, want) < 1e-4


def test_a_dry_run_prints_decode_and_prefill_rows(bench, capsys):
    bench.main(["--device", "cpu", "--tiny", "--no-append", "--context", "16", "--lengths", "32", "--batches", "2"])
    out = capsys.readouterr().out
    assert "| decode, batch 2, context 16 (hyserve: eager) |" in out
    assert "| prefill, 32 tokens, one sequence |" in out
