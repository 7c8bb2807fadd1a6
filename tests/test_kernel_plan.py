"""The kernel plan (hyserve/ops/kernel_plan.py): decided from the model's shapes and a device description,
so the choices for an H200 are checked here on the CPU. On an H200 they must be the choices the layers made
inline before the plan existed (the thresholds docs/gpu_fast_path_notes.md measured); on the CPU, the
reference everywhere."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hyserve import envs
from hyserve.models import load_model
from hyserve.models.config import parse_config
from hyserve.models.presets import PRESETS, preset_config
from hyserve.ops.device_spec import H200, DeviceSpec
from hyserve.ops.dispatch import reference_ops
from hyserve.ops.kernel_plan import REFERENCE, REFERENCE_PLAN, active, gemv_config, plan_kernels

BF16, F32 = torch.bfloat16, torch.float32


def h200_plan(name: str, **environ: str):
    cfg = parse_config(preset_config(name))
    return plan_kernels(cfg, H200, BF16 if cfg.dtype == "bfloat16" else F32, env=envs.read(environ))


# preset -> (KDA decode, KDA prefill, MLA, MLA decode layout, DSA index, FP8 dot, sparse MLA, shared expert in the GEMV)
ON_H200 = {
    "kimi-linear-48b-a3b": ("triton", "fla", "merged", "auto", REFERENCE, False, REFERENCE, True),
    "kimi-linear-tiny": ("triton", "fla", "merged", "heads", REFERENCE, False, REFERENCE, True),
    "k3-tiny": ("triton", "fla", "merged", "heads", REFERENCE, False, REFERENCE, False),
    "k3-mini": ("triton", "fla", "merged", "auto", REFERENCE, False, REFERENCE, False),
    "k3.1-tiny": ("triton", "fla", REFERENCE, "heads", "triton", False, "triton", False),
    "k3.1-mini": ("triton", "fla", REFERENCE, "auto", "triton", True, "triton", False),
}


def test_every_preset_has_its_expected_h200_plan():
    assert set(ON_H200) == set(PRESETS)


@pytest.mark.parametrize("name", sorted(ON_H200))
def test_the_h200_plan_of_each_preset_takes_the_kernels_the_layers_took_inline(name):
    p = h200_plan(name)
    got = (p.kda_decode, p.kda_prefill, p.mla, p.mla_decode_layout, p.dsa_index, p.dsa_fp8_dot, p.dsa_sparse_mla,
           p.moe_gemv_shared)
    assert got == ON_H200[name]
    assert p.triton and p.router == "triton"


@pytest.mark.parametrize("name", sorted(ON_H200))
def test_the_h200_plan_switches_kernels_at_the_measured_token_counts(name):
    p = h200_plan(name)
    assert [p.router_kernel(t, grad=False) for t in (1, 8, 9, 8192)] == ["fused", "fused", "select", "select"]
    assert p.router_kernel(1, grad=True) == REFERENCE  # the selection kernel has no backward
    dtype = BF16 if p.dtype == "bfloat16" else F32
    assert p.moe_experts(64, dtype, grad=False) == "gemv" and p.moe_experts(64, dtype, grad=True) == "gemv"
    assert p.moe_experts(65, BF16, grad=False) == "triton" and p.moe_experts(65, torch.float16, grad=False) == "triton"
    assert p.moe_experts(65, F32, grad=False) == REFERENCE  # fp32 keeps the exact loop
    assert p.moe_experts(65, BF16, grad=True) == ("grouped_mm" if p.dtype == "bfloat16" else REFERENCE)
    assert (p.kda_fused_norm(527), p.kda_fused_norm(528)) == (True, False)
    one, two = torch.empty(1, 64, device="meta"), torch.empty(2, 64, device="meta")
    assert p.dense_mlp_one_token(one, "silu") and not p.dense_mlp_one_token(two, "silu")
    assert not p.dense_mlp_one_token(one, "situ")
    assert p.kda_kernels(prefill=False) and p.kda_kernels(prefill=True)


def test_mla_with_a_cache_in_another_dtype_keeps_the_kernels_but_not_the_merged_row_write():
    p = h200_plan("kimi-linear-48b-a3b")
    assert p.mla_path(BF16, BF16) == "merged" and p.mla_path(F32, BF16) == "triton"


def test_the_indexer_scores_only_contexts_longer_than_top_k():
    p = h200_plan("k3.1-mini")
    assert (p.dsa_index_kernel(2048), p.dsa_index_kernel(2049)) == (REFERENCE, "triton")


def test_without_fla_a_kda_prefill_runs_the_reference_and_decode_steps_keep_the_kernel():
    cfg = parse_config(preset_config("kimi-linear-48b-a3b"))
    p = plan_kernels(cfg, dataclasses.replace(H200, fla=False), BF16, env=envs.read({}))
    assert p.kda_prefill == REFERENCE and p.kda_kernels(prefill=False) and not p.kda_kernels(prefill=True)


@pytest.mark.parametrize("name", sorted(ON_H200))
def test_the_verify_kernel_goes_where_the_decode_kernel_goes(name):
    """Speculative verify rows take kda_verify_multi wherever the decode kernel runs (it is the decode
    kernel's prep and finish around its own state kernel): with or without fla, up to 16 tokens a row."""
    p = h200_plan(name)
    assert p.kda_verify == p.kda_decode == "triton"
    assert p.kda_kernels(prefill=False, verify_tokens=2) and p.kda_kernels(prefill=True, verify_tokens=16)
    assert not p.kda_kernels(prefill=False, verify_tokens=17)  # past the state kernel's unrolled tokens
    cfg = parse_config(preset_config(name))
    no_fla = plan_kernels(cfg, dataclasses.replace(H200, fla=False), BF16, env=envs.read({}))
    assert no_fla.kda_verify == "triton" and no_fla.kda_kernels(prefill=False, verify_tokens=4)
    assert not no_fla.kda_kernels(prefill=True, verify_tokens=4)


def test_without_the_decode_kernel_verify_rows_run_the_reference():
    c = preset_config("kimi-linear-tiny")
    c["linear_attn_config"]["head_dim"] = 24  # not a power of two: no KDA kernel spans the head
    odd = plan_kernels(parse_config(c), H200, F32, env=envs.read({}))
    assert odd.kda_decode == odd.kda_verify == REFERENCE
    assert not odd.kda_kernels(prefill=False, verify_tokens=2)
    forced = h200_plan("kimi-linear-tiny", HYSERVE_REFERENCE_OPS="1")
    assert forced.kda_verify == REFERENCE and not forced.kda_kernels(prefill=False, verify_tokens=2)
    cpu = load_model("kimi-linear-tiny", dtype="float32", device="cpu").kernel_plan
    assert cpu.kda_verify == REFERENCE and not cpu.kda_kernels(prefill=False, verify_tokens=2)


def test_the_48b_single_token_projections_keep_their_measured_gemv_tiles():
    p = h200_plan("kimi-linear-48b-a3b")
    assert {(n, k, silu): p.gemv_config(n, k, silu) for _, n, k, silu in p.gemv_weights} == {
        (163840, 2304, False): (16, 256, 8, 4, 1),  # lm_head
        (2304, 4096, False): (16, 256, 8, 4, 4),  # KDA and MLA o_proj
        (2304, 9216, True): (16, 256, 8, 3, 4),  # layer 0's MLP down, SiLU-GLU read in
    }


def test_another_models_projections_get_gemv_tiles_by_the_same_rule():
    p = h200_plan("k3-mini")
    x = torch.empty(1, 12288, dtype=BF16, device="meta")
    w = torch.empty(7168, 12288, dtype=BF16, device="meta")
    assert p.linear_gemv(x, w) == (16, 256, 8, 4, 2)  # 448 row blocks: split K in 2 to fill 132 SMs
    assert p.linear_gemv(x.float(), w.float()) is None  # fp32 stays on cuBLAS
    assert p.linear_gemv(torch.empty(2, 12288, dtype=BF16, device="meta"), w) is None  # one token only
    assert gemv_config(1000, 3000, False, 132) == (16, 256, 8, 4, 2)  # no table: any shape has tiles
    assert gemv_config(2304, 4096, False, 108)[-1] == 3  # and the split follows the SM count


def test_a_gpu_without_hopper_takes_the_triton_mla_kernel_and_no_grouped_mm():
    a100 = DeviceSpec("cuda", "A100", (8, 0), 108, True, True, True, True)
    p = plan_kernels(parse_config(preset_config("kimi-linear-48b-a3b")), a100, BF16, env=envs.read({}))
    assert p.mla_decode_layout == "heads" and not p.moe_grouped_mm and p.kda_decode == "triton"


def test_env_switches_turn_kernels_off_in_the_plan():
    assert not h200_plan("kimi-linear-48b-a3b", HYSERVE_REFERENCE_OPS="1").triton
    off = h200_plan("k3.1-mini", HYSERVE_DSA_TRITON="0")
    assert (off.dsa_index, off.dsa_sparse_mla, off.kda_decode) == (REFERENCE, REFERENCE, "triton")
    assert not h200_plan("k3.1-mini", HYSERVE_DSA_EXACT_SCORES="1").dsa_fp8_dot


def test_on_the_cpu_the_plan_says_reference_everywhere():
    model = load_model("k3-tiny", dtype="float32", device="cpu")
    p = model.kernel_plan
    assert not p.triton and p.kda_decode == p.kda_prefill == p.mla == p.router == REFERENCE
    assert p.moe_experts(1, F32, grad=False) == REFERENCE and p.router_kernel(1, grad=False) == REFERENCE
    assert not p.kda_kernels(prefill=False) and not p.kda_kernels(prefill=False, verify_tokens=2)
    assert p.table() == "kernel plan: KimiK3ForCausalLM in float32 on cpu: every layer runs its torch reference"


def test_the_model_plans_again_only_when_it_changes_dtype_or_device():
    model = load_model("k3-tiny", dtype="float32", device="cpu")
    assert model.kernel_plan is model.kernel_plan
    assert model.to(BF16).kernel_plan.dtype == "bfloat16"


def test_reference_ops_override_any_plan():
    plan = h200_plan("kimi-linear-48b-a3b")
    assert active(plan) is plan and active(None) is REFERENCE_PLAN
    with reference_ops():
        assert active(plan) is REFERENCE_PLAN


def test_the_training_plan_keeps_the_kernels_and_adds_the_batched_paths():
    plan = h200_plan("kimi-linear-48b-a3b").for_training()
    assert plan.training and plan.train_fla and plan.kda_decode == "triton"
    assert not h200_plan("kimi-linear-48b-a3b").for_training(fla=False).train_fla


def test_the_table_names_each_kernel_and_the_counts_that_switch_them():
    table = h200_plan("kimi-linear-48b-a3b").table()
    assert table.startswith("kernel plan: KimiLinearForCausalLM in bfloat16 on NVIDIA H200")
    for part in ("KDA decode", "528 (sequence, head) pairs", "fla chunk_kda", "KDA verify", "kda_verify_multi", "Gluon wgmma", ">= 8 tiles",
                 "up to 8 tokens", "up to 64 token-expert pairs with the shared expert", "163840x2304",
                 "(16, 256, 8, 4, 4)", "SiLU-GLU: GEMV tiles (16, 256, 8, 3, 4)"):
        assert part in table, part
    assert "DSA indexer" in h200_plan("k3.1-mini").table() and "DSA" not in table
