"""Shard specs, without processes: every parameter of the tiny presets has a rule, the rule's shape is the
rank model's shape, slices read from safetensors equal slices of the tensor, and a layout the model
cannot split is refused with a message naming the dimension."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from hyserve.distributed import ParallelConfig, ParallelConfigError, check_model_splits
from hyserve.distributed.comm import Group
from hyserve.distributed.context import StepContext
from hyserve.distributed.groups import ParallelState
from hyserve.distributed.model import ParallelCausalLM
from hyserve.distributed.sharding import Split, param_spec, param_specs
from hyserve.models.config import parse_config
from hyserve.models.kimi import KimiForCausalLM
from hyserve.models.presets import preset_config

PRESETS = ["kimi-linear-tiny", "k3-tiny", "k3.1-tiny"]
LAYOUTS = [ParallelConfig(tensor_parallel_size=2), ParallelConfig(tensor_parallel_size=4),
           ParallelConfig(tensor_parallel_size=4, enable_expert_parallel=True)]


def _state(p: ParallelConfig, rank: int) -> ParallelState:
    """Groups without a process group: enough to build a rank's modules (building communicates nothing)."""
    ranks = list(range(p.world_size))
    g = Group("tp", ranks, rank, 1.0)
    ep = g if p.enable_expert_parallel else Group("ep", [rank], 0, 1.0)
    return ParallelState(p, rank, g, ep, Group("dcp", [rank], 0, 1.0), torch.device("cpu"))


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda p: f"tp{p.tensor_parallel_size}{'ep' * p.enable_expert_parallel}")
@pytest.mark.parametrize("preset", PRESETS)
def test_every_parameter_has_a_spec_with_the_rank_models_shape(preset, layout):
    cfg = parse_config(preset_config(preset))
    with torch.device("meta"):
        full = dict(KimiForCausalLM(cfg).named_parameters())
        for rank in (0, layout.world_size - 1):
            local = dict(ParallelCausalLM(cfg, StepContext(_state(layout, rank))).named_parameters())
            assert local.keys() == full.keys()
            specs = param_specs(cfg, layout, full)
            for name, p in full.items():
                assert specs[name].local_shape(tuple(p.shape)) == tuple(local[name].shape), name


def test_an_unknown_parameter_has_no_rule():
    cfg = parse_config(preset_config("k3-tiny"))
    with pytest.raises(KeyError, match="no sharding rule"):
        param_spec(cfg, ParallelConfig(tensor_parallel_size=2), "model.layers.0.self_attn.new_proj.weight")


def test_safetensors_slices_equal_tensor_slices(tmp_path):
    cfg = parse_config(preset_config("k3-tiny"))
    gen = torch.Generator().manual_seed(0)
    with torch.device("meta"):
        shapes = {n: tuple(p.shape) for n, p in KimiForCausalLM(cfg).named_parameters()}
    tensors = {n: torch.randn(s, generator=gen) for n, s in shapes.items()}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    for layout in LAYOUTS:
        specs = param_specs(cfg, layout, tensors)
        with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
            for rank in range(layout.world_size):
                for name, spec in specs.items():
                    assert torch.equal(spec.take_slice(f.get_slice(name), rank), spec.take(tensors[name], rank)), name


def test_a_padded_a_log_reads_only_the_head_range(tmp_path):
    # K3 stores A_log as [128]: the heads first, zeros after; a rank reads only its heads
    heads = torch.arange(1.0, 9.0)
    save_file({"A_log": torch.cat([heads, torch.zeros(8)])}, str(tmp_path / "a.safetensors"))
    spec = Split(0, 8, 4)
    with safe_open(str(tmp_path / "a.safetensors"), framework="pt") as f:
        assert torch.equal(spec.take_slice(f.get_slice("A_log"), 3), heads[6:8])


def test_a_part_of_a_grouped_split_is_that_part_of_the_rank_slice():
    conv = torch.arange(3 * 8 * 2.0).view(24, 2)  # q | k | v channels of a [3P, W] conv, P = 8
    spec = Split(0, 24, 4, groups=3)
    for rank in range(4):
        q, k, v = spec.take(conv, rank).chunk(3)
        assert torch.equal(k, spec.part().take(conv[8:16], rank))


def test_vocab_rows_are_padded_to_equal_shards():
    spec = Split(0, 10, 4, pad=True)
    emb = torch.arange(10.0)[:, None]
    assert [spec.take(emb, r).flatten().tolist() for r in range(4)] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 0, 0]]


def test_expert_split_owns_consecutive_experts():
    assert [list(Split(0, 8, 4).owned(r)) for r in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_a_layout_the_model_cannot_split_is_refused_with_the_dimension():
    cfg = parse_config(preset_config("k3-tiny"))  # 4 MLA and 4 KDA heads, 8 experts
    with pytest.raises(ParallelConfigError, match=r"num_attention_heads \(MLA heads\) = 4 is not divisible by 8"):
        check_model_splits(cfg, ParallelConfig(tensor_parallel_size=8))
    with pytest.raises(ParallelConfigError, match="KDA num_heads = 4 is not divisible by 3"):
        check_model_splits(cfg, ParallelConfig(tensor_parallel_size=3))
    check_model_splits(cfg, ParallelConfig(tensor_parallel_size=4, enable_expert_parallel=True))


def test_experts_must_divide_over_expert_parallel_ranks():
    cfg = parse_config(dict(preset_config("k3-tiny"), num_experts=6))
    with pytest.raises(ParallelConfigError, match="num_experts = 6 is not divisible by 4"):
        check_model_splits(cfg, ParallelConfig(tensor_parallel_size=4, enable_expert_parallel=True))


def test_dcp_must_divide_tp():
    with pytest.raises(ParallelConfigError, match="divisible by decode_context_parallel_size"):
        ParallelConfig(tensor_parallel_size=4, decode_context_parallel_size=3)
