"""The rank model's kernel plan: decided from the rank's own shapes, and handed by every parallel layer to
the single-device layer it wraps, so a rank takes the kernels the plan picks for it (not the reference
plan a layer falls back to without one)."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from dist_util import PAGE_BLOCK, rank_pool, run_steps

from hyserve.distributed import ParallelConfig
from hyserve.distributed.comm import Group
from hyserve.distributed.context import StepContext
from hyserve.distributed.groups import ParallelState
from hyserve.distributed.model import build_rank_model, shard_model
from hyserve.models.config import parse_config
from hyserve.models.loader import load_model
from hyserve.models.presets import preset_config
from hyserve.ops.kernel_plan import KernelPlan

PRESETS = ["kimi-linear-tiny", "k3-tiny", "k3.1-tiny"]


class RecordingPlan(KernelPlan):
    """The reference plan, counting the questions the layers ask it."""

    def __init__(self) -> None:
        super().__init__()
        object.__setattr__(self, "asked", Counter())

    def kda_kernels(self, prefill: bool, verify_tokens: int = 0) -> bool:
        self.asked["KDA"] += 1
        return super().kda_kernels(prefill, verify_tokens)

    def mla_path(self, cache_dtype: torch.dtype, dtype: torch.dtype) -> str:
        self.asked["MLA"] += 1
        return super().mla_path(cache_dtype, dtype)

    def linear_gemv(self, x, weight, out=None):
        self.asked["MLA output projection"] += 1
        return super().linear_gemv(x, weight, out)

    def router_kernel(self, tokens: int, grad: bool) -> str:
        self.asked["router"] += 1
        return super().router_kernel(tokens, grad)

    def moe_experts(self, pairs: int, dtype: torch.dtype, grad: bool) -> str:
        self.asked["routed experts"] += 1
        return super().moe_experts(pairs, dtype, grad)

    def dense_mlp_one_token(self, x, act_kind, *weights) -> bool:
        self.asked["dense MLP and shared experts"] += 1
        return super().dense_mlp_one_token(x, act_kind, *weights)


class Recorded:
    """A model whose forward runs a fresh RecordingPlan; `asked` sums the questions of every step."""

    def __init__(self, model):
        self.model, self.asked = model, Counter()
        self.full_config = getattr(model, "full_config", model.config)

    def __getattr__(self, name):
        return getattr(self.model, name)

    def __call__(self, ids, batch, cache):
        plan = RecordingPlan()
        hidden = self.model(ids, batch, cache, plan)
        self.asked += plan.asked
        return hidden


def _questions(state, preset: str, sequence_parallel: bool) -> tuple[Counter, Counter]:
    """(what the single-device model's layers ask the plan over the scenario, what this rank's layers ask)."""
    model = load_model(preset, dtype="float32")
    ref = Recorded(model)
    run_steps(ref)
    got = Recorded(shard_model(model, StepContext(state, sequence_parallel=sequence_parallel)))
    run_steps(got, batch_block=PAGE_BLOCK * state.dcp.size)
    return ref.asked, got.asked


@pytest.mark.parametrize("layout", ["tp", "tp_ep", "tp_ep_sp"])
@pytest.mark.parametrize("preset", PRESETS)
def test_every_parallel_layer_asks_the_plan_it_is_handed(preset, layout):
    p = ParallelConfig(tensor_parallel_size=2, enable_expert_parallel="ep" in layout)
    for ref, got in rank_pool(2).run(_questions, preset, layout.endswith("sp"), layout=p):
        assert got == ref and ref["KDA"] and ref["MLA"] and ref["routed experts"]


@pytest.mark.parametrize("preset", PRESETS)
def test_dcp_attention_asks_the_plan_for_its_output_projection(preset):
    """Under DCP the attention is torch code (docs/parallelism.md): only MLA's own path choice is not asked."""
    p = ParallelConfig(tensor_parallel_size=2, decode_context_parallel_size=2)
    for ref, got in rank_pool(2).run(_questions, preset, False, layout=p):
        assert got == ref - Counter({"MLA": ref["MLA"]}) and got["MLA output projection"] == ref["MLA"]


def _rank_model(preset: str, tp: int, expert_parallel: bool):
    """Rank 1's model of a TP layout, built (not loaded: nothing communicates) on the CPU."""
    cfg = parse_config(preset_config(preset))
    layout = ParallelConfig(tensor_parallel_size=tp, enable_expert_parallel=expert_parallel)
    tp_group = Group("tp", list(range(tp)), 1, 60.0)
    state = ParallelState(layout, 1, tp_group, tp_group if expert_parallel else Group("ep", [1], 0, 60.0),
                          Group("dcp", [1], 0, 60.0), torch.device("cpu"))
    return cfg, build_rank_model(cfg, StepContext(state), "cpu", lambda name: torch.float32)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("preset", PRESETS)
def test_the_rank_plans_its_single_token_projections_at_its_own_weight_shapes(preset, tp):
    cfg, model = _rank_model(preset, tp, expert_parallel=False)
    layers = model.model.layers
    weights = {"lm_head": model.lm_head.weight,
               "KDA o_proj": layers[cfg.layer_types.index("kda")].self_attn.o_proj.weight,
               "MLA o_proj": layers[cfg.layer_types.index("mla")].self_attn.o_proj.weight}
    if "dense" in cfg.mlp_types and cfg.hidden_act == "silu":
        weights["MLP down_proj"] = layers[cfg.mlp_types.index("dense")].mlp.down_proj.weight
    rows = model.kernel_plan.gemv_weights
    assert {name for names, *_ in rows for name in names.split(" & ")} == set(weights)
    for names, n, k, _ in rows:
        for name in names.split(" & "):
            assert weights[name].shape == (n, k), name
    assert model.lm_head.weight.shape[0] == math.ceil(cfg.vocab_size / tp)


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_the_rank_config_holds_the_expert_width_it_runs(expert_parallel):
    cfg, model = _rank_model("k3-tiny", 2, expert_parallel)
    moe = next(layer.block_sparse_moe for layer in model.model.layers if hasattr(layer, "block_sparse_moe"))
    assert model.config.moe_intermediate_size == moe.w2.shape[2]
    assert moe.w2.shape[2] == cfg.moe_intermediate_size // (1 if expert_parallel else 2)
