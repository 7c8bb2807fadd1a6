"""A rank's weights through the product loader (`load_model(..., parallel=ctx)`), without processes
(loading communicates nothing): from a checkpoint in every spelling the loader reads, each rank's
parameters are its shard-spec slices of the single-device model's, and it reads only those slices of the
big tensors; random weights are the single-device model's, cut. And the layout checks an engine makes
before starting any process."""

from __future__ import annotations

import json

import pytest
import safetensors
import torch
from safetensors.torch import save_file

from hyserve.config import EngineConfig
from hyserve.distributed import ParallelConfig, ParallelConfigError
from hyserve.distributed.comm import Group
from hyserve.distributed.context import StepContext
from hyserve.distributed.executor import check_layout
from hyserve.distributed.groups import ParallelState
from hyserve.distributed.sharding import param_specs
from hyserve.models.checkpoint_writer import checkpoint_views, write_checkpoint
from hyserve.models.config import parse_config
from hyserve.models.loader import build_model, load_model, random_init
from hyserve.models.presets import preset_config
from hyserve.models.weight_assembler import CheckpointError, dequant_mxfp4

TP2, TP2_EP = ParallelConfig(tensor_parallel_size=2), ParallelConfig(tensor_parallel_size=2, enable_expert_parallel=True)


def _ctx(p: ParallelConfig, rank: int) -> StepContext:
    """A rank's context without process groups: enough to build and fill its model."""
    ranks = list(range(p.world_size))
    tp = Group("tp", ranks, rank, 1.0)
    ep = tp if p.enable_expert_parallel else Group("ep", [rank], 0, 1.0)
    return StepContext(ParallelState(p, rank, tp, ep, Group("dcp", [rank], 0, 1.0), torch.device("cpu")))


def _assert_rank_slices(rank_model, full_model, layout: ParallelConfig, rank: int) -> None:
    full = dict(full_model.named_parameters())
    specs = param_specs(full_model.config, layout, full)
    for name, p in rank_model.named_parameters():
        assert torch.equal(p, specs[name].take(full[name].data, rank)), name


def _raw(preset: str, **changes) -> dict:
    return dict(preset_config(preset), **changes)


def _write(tmp_path, raw: dict, tensors: dict[str, torch.Tensor]) -> str:
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return str(tmp_path)


class _Counted:
    """A safetensors slice handle that counts the elements read through it."""

    def __init__(self, sl, counts: dict):
        self.sl, self.counts = sl, counts

    def get_shape(self):
        return self.sl.get_shape()

    def __getitem__(self, index):
        t = self.sl[index]
        self.counts["read"] += t.numel()
        return t


class _CountingFile:
    def __init__(self, f, counts: dict):
        self.f, self.counts = f, counts

    def __enter__(self):
        self.f.__enter__()
        return self

    def __exit__(self, *exc):
        return self.f.__exit__(*exc)

    def keys(self):
        return self.f.keys()

    def get_slice(self, key):
        return _Counted(self.f.get_slice(key), self.counts)

    def get_tensor(self, key):
        raise AssertionError(f"a rank read the whole of {key}")


@pytest.mark.parametrize("layout", [TP2, TP2_EP], ids=["tp2", "tp2-ep"])
@pytest.mark.parametrize("preset", ["kimi-linear-tiny", "k3.1-tiny"])
def test_a_rank_reads_only_its_slices_of_the_checkpoint(tmp_path, monkeypatch, preset, layout):
    full = load_model(preset, dtype="float32", seed=4)
    write_checkpoint(full, preset_config(preset), str(tmp_path), torch.float32, shard_bytes=64_000)
    counts = {"read": 0}
    real_open = safetensors.safe_open
    monkeypatch.setattr(safetensors, "safe_open", lambda *a, **k: _CountingFile(real_open(*a, **k), counts))
    total = sum(p.numel() for p in full.parameters())
    for rank in range(2):
        counts["read"] = 0
        model = load_model(str(tmp_path), dtype="float32", parallel=_ctx(layout, rank))
        _assert_rank_slices(model, full, layout, rank)
        held = sum(p.numel() for p in model.parameters())
        # what it holds and no more (but small vectors read whole: a padded A_log), of a fraction of the whole
        assert held <= counts["read"] <= held + 64 and held < 0.75 * total


def _runtime_spelling(model) -> dict[str, torch.Tensor]:
    """transformers-5's names: one q|k|v conv1d, experts stacked as gate_up_proj / down_proj, A_log as
    [1, 1, H, 1] under forget_gate."""
    out, convs, experts = {}, {}, {}
    for name, t in checkpoint_views(model):
        if name.endswith(("q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight")):
            convs.setdefault(name.rsplit(".", 2)[0], []).append(t)
        elif ".experts." in name:
            base, e, w = name.rsplit(".experts.", 1)[0], *name.rsplit(".experts.", 1)[1].split(".")[:2]
            experts.setdefault(base, {}).setdefault(w, {})[int(e)] = t
        elif name.endswith("A_log"):
            out[name.replace("self_attn.A_log", "self_attn.forget_gate.A_log")] = t.view(1, 1, -1, 1)
        else:
            out[name] = t
    for base, parts in convs.items():
        out[base + ".conv1d.weight"] = torch.cat(parts)
    for base, ws in experts.items():
        n = len(ws["w1"])
        out[base + ".experts.gate_up_proj"] = torch.stack([torch.cat([ws["w1"][e], ws["w3"][e]]) for e in range(n)])
        out[base + ".experts.down_proj"] = torch.stack([ws["w2"][e] for e in range(n)])
    return out


@pytest.mark.parametrize("layout", [TP2, TP2_EP], ids=["tp2", "tp2-ep"])
def test_a_rank_reads_the_transformers_spelling(tmp_path, layout):
    full = load_model("kimi-linear-tiny", dtype="float32", seed=2)
    path = _write(tmp_path, preset_config("kimi-linear-tiny"), _runtime_spelling(full))
    assert torch.equal(load_model(path, dtype="float32").model.layers[0].self_attn.A_log, full.model.layers[0].self_attn.A_log)
    for rank in range(2):
        _assert_rank_slices(load_model(path, dtype="float32", parallel=_ctx(layout, rank)), full, layout, rank)


@pytest.mark.parametrize("layout", [TP2, TP2_EP], ids=["tp2", "tp2-ep"])
def test_mxfp4_experts_are_split_by_rows_and_whole_scale_groups(tmp_path, layout):
    raw = _raw("k3-tiny", moe_intermediate_size=64)  # w2's 64 columns: 32 per rank, one scale group each
    source = build_model(parse_config(raw), torch.float32, "cpu")
    random_init(source, seed=1)
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for name, view in checkpoint_views(source):
        if ".experts." not in name:
            tensors[name] = view
            continue
        rows, cols = view.shape
        base = name[: -len(".weight")]
        tensors[base + ".weight_packed"] = torch.randint(0, 256, (rows, cols // 2), dtype=torch.uint8, generator=gen)
        tensors[base + ".weight_scale"] = torch.randint(120, 130, (rows, cols // 32), dtype=torch.uint8, generator=gen)
    path = _write(tmp_path, raw, tensors)
    full = load_model(path, dtype="float32")
    w2 = dequant_mxfp4(tensors["model.layers.1.block_sparse_moe.experts.3.w2.weight_packed"],
                       tensors["model.layers.1.block_sparse_moe.experts.3.w2.weight_scale"])
    assert torch.equal(full.model.layers[1].block_sparse_moe.w2[3], w2)
    for rank in range(2):
        _assert_rank_slices(load_model(path, dtype="float32", parallel=_ctx(layout, rank)), full, layout, rank)


def test_mxfp4_w2_columns_that_split_a_scale_group_are_refused(tmp_path):
    source = load_model("k3-tiny", dtype="float32")  # moe_intermediate_size 32: 16 columns a rank
    tensors = {}
    for name, view in checkpoint_views(source):
        if name.endswith("experts.0.w2.weight"):
            base = name[: -len(".weight")]
            tensors[base + ".weight_packed"] = torch.zeros(view.shape[0], view.shape[1] // 2, dtype=torch.uint8)
            tensors[base + ".weight_scale"] = torch.full((view.shape[0], view.shape[1] // 32), 127, dtype=torch.uint8)
        else:
            tensors[name] = view
    path = _write(tmp_path, preset_config("k3-tiny"), tensors)
    with pytest.raises(CheckpointError, match="not a multiple of 32"):
        load_model(path, dtype="float32", parallel=_ctx(TP2, 0))


@pytest.mark.parametrize("layout", [TP2, TP2_EP, ParallelConfig(tensor_parallel_size=4)], ids=["tp2", "tp2-ep", "tp4"])
def test_random_weights_of_a_rank_are_its_slices_of_the_single_process_weights(layout):
    full = load_model("k3.1-tiny", dtype="float32", seed=9)
    for rank in range(layout.world_size):
        _assert_rank_slices(load_model("k3.1-tiny", dtype="float32", seed=9, parallel=_ctx(layout, rank)), full, layout, rank)


def test_a_layout_the_model_cannot_split_is_refused_before_any_process_starts():
    with pytest.raises(ParallelConfigError, match=r"num_attention_heads \(MLA heads\) = 4 is not divisible by 8"):
        check_layout(EngineConfig(model="k3-tiny", tensor_parallel_size=8), "cpu")
    with pytest.raises(ParallelConfigError, match="KDA num_heads = 4 is not divisible by 3"):
        check_layout(EngineConfig(model="kimi-linear-tiny", tensor_parallel_size=3), "cpu")


def test_more_ranks_than_visible_gpus_are_refused():
    visible = torch.cuda.device_count()
    n = visible + 1 if visible else 2
    with pytest.raises(ParallelConfigError, match=f"tensor_parallel_size {n} needs {n} GPUs; {visible} are visible"):
        check_layout(EngineConfig(model="k3-tiny", tensor_parallel_size=n), "cuda")
