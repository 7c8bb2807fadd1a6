"""`load_format` (vLLM's names) on load_model, EngineConfig / LLM and the CLI: the streamed safetensors
reader, the optional fastsafetensors reader, dummy weights at a config directory's shape, and the
errors when a format cannot apply."""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging

import pytest
import torch
from safetensors.torch import save_file

from hyserve import LLM, EngineConfig, SamplingParams
from hyserve.entrypoints.generate import add_generate_parser, run_generate
from hyserve.models import CheckpointError
from hyserve.models.checkpoint_writer import checkpoint_views, write_checkpoint
from hyserve.models.config import parse_config
from hyserve.models.device_init import materialize
from hyserve.models.loader import build_model, load_model, random_init
from hyserve.models.presets import preset_config


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """(k3-tiny in bf16 with random weights, its directory in shards of 64 KB: a layer's experts span files)."""
    raw = dict(preset_config("k3-tiny"), dtype="bfloat16")
    model = build_model(parse_config(raw), torch.bfloat16, "cpu")
    random_init(model, seed=5)
    out = tmp_path_factory.mktemp("sharded")
    write_checkpoint(model, raw, str(out), torch.bfloat16, shard_bytes=64_000)
    return model, out


def _assert_same_weights(a, b) -> None:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    for name in pa:
        assert pa[name].dtype == pb[name].dtype and torch.equal(pa[name], pb[name]), name


@pytest.mark.parametrize("load_format", ["auto", "safetensors", "fastsafetensors"])
def test_loaded_weights_equal_the_saved_ones(sharded, load_format):
    if load_format == "fastsafetensors":
        pytest.importorskip("fastsafetensors")
    source, path = sharded
    assert len(list(path.glob("model-*.safetensors"))) > 5
    _assert_same_weights(load_model(str(path), load_format=load_format), source)


def test_the_start_up_log_gives_load_time_rate_and_memory(sharded, caplog):
    _, path = sharded
    with caplog.at_level(logging.INFO, logger="hyserve.models.loader"):
        model = load_model(str(path))
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("Loaded "))
    assert "GB/s, load format safetensors" in line and "host memory peak" in line
    report = model.load_report
    assert report.num_files == len(list(path.glob("model-*.safetensors"))) and report.seconds > 0
    assert report.weight_bytes == sum(p.numel() * p.element_size() for p in model.parameters())


def test_dummy_loads_a_config_directory_without_weight_files(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(preset_config("k3-tiny")))
    model = load_model(str(tmp_path), load_format="dummy", seed=3)
    # the checkpoint's real shape with the presets' random weights
    _assert_same_weights(model, load_model("k3-tiny", seed=3))
    assert model.load_report.load_format == "dummy" and model.load_report.read_bytes == 0


def test_llm_and_generate_run_a_config_directory_with_dummy_weights(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(preset_config("k3-tiny")))
    llm = LLM(str(tmp_path), load_format="dummy", device="cpu", block_size=16)
    out = llm.generate(["hi"], SamplingParams(max_tokens=3, ignore_eos=True, temperature=0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    parser = argparse.ArgumentParser()
    add_generate_parser(parser.add_subparsers())
    args = parser.parse_args(["generate", str(tmp_path), "--load-format", "dummy", "--prompt", "hi", "--device",
                              "cpu", "--block-size", "16", "--max-tokens", "2", "--ignore-eos"])
    assert run_generate(args) == 0
    assert "(length, 2 tokens)" in capsys.readouterr().out


def test_reading_weights_from_a_directory_without_any_names_the_missing_files(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(preset_config("k3-tiny")))
    with pytest.raises(CheckpointError, match="no .safetensors files"):
        load_model(str(tmp_path))


@pytest.mark.parametrize("load_format", ["safetensors", "fastsafetensors"])
def test_a_preset_has_no_files_to_read(load_format):
    with pytest.raises(CheckpointError, match="preset.*use auto or dummy"):
        load_model("k3-tiny", load_format=load_format)


def test_an_unknown_load_format_is_refused_before_anything_loads():
    with pytest.raises(ValueError, match="load_format must be one of auto, safetensors, fastsafetensors, dummy"):
        EngineConfig(model="k3-tiny", load_format="pt")


def test_fastsafetensors_not_installed_names_the_pip_package(monkeypatch, sharded):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "fastsafetensors" else real(name, *a))
    with pytest.raises(ValueError, match="pip install fastsafetensors"):
        EngineConfig(model="k3-tiny", load_format="fastsafetensors")
    monkeypatch.setitem(__import__("sys").modules, "fastsafetensors", None)  # import fails
    with pytest.raises(CheckpointError, match="pip install fastsafetensors"):
        load_model(str(sharded[1]), load_format="fastsafetensors")


def test_mxfp4_experts_are_dequantised_into_their_slices(tmp_path, sharded):
    source, path = sharded
    raw = json.loads((path / "config.json").read_text())
    cfg = parse_config(raw)
    gen = torch.Generator().manual_seed(0)
    tensors, want = {}, {}
    for name, view in checkpoint_views(source):
        if ".experts." not in name:
            tensors[name] = view.contiguous()
            continue
        rows, cols = view.shape
        packed = torch.randint(0, 256, (rows, cols // 2), dtype=torch.uint8, generator=gen)
        scale = torch.randint(120, 130, (rows, cols // 32), dtype=torch.uint8, generator=gen)
        base = name[: -len(".weight")]
        tensors[base + ".weight_packed"], tensors[base + ".weight_scale"] = packed, scale
        want[name] = (packed, scale)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(raw))
    model = load_model(str(tmp_path))
    moe = model.model.layers[1].block_sparse_moe
    inter = moe.w13.shape[1] // 2
    from hyserve.models.weight_assembler import dequant_mxfp4

    w1 = dequant_mxfp4(*want["model.layers.1.block_sparse_moe.experts.3.w1.weight"]).to(moe.w13.dtype)
    w2 = dequant_mxfp4(*want["model.layers.1.block_sparse_moe.experts.3.w2.weight"]).to(moe.w2.dtype)
    assert torch.equal(moe.w13[3, :inter], w1) and torch.equal(moe.w2[3], w2)
    assert cfg.num_experts == moe.w13.shape[0]


def test_an_mxfp4_matrix_without_its_scales_is_named(tmp_path, sharded):
    source, path = sharded
    tensors = {n: v.contiguous() for n, v in checkpoint_views(source)}
    key = "model.layers.1.block_sparse_moe.experts.0.w2.weight"
    w = tensors.pop(key)
    tensors[key + "_packed"] = torch.zeros(w.shape[0], w.shape[1] // 2, dtype=torch.uint8)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    with pytest.raises(CheckpointError, match=r"experts\.0\.w2: weight_packed without weight_scale"):
        load_model(str(tmp_path))


class _WithTable(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(4, 4))
        self.register_buffer("table", torch.arange(4.0))

    def init_buffers(self) -> None:
        self.table = torch.arange(4.0, device=self.weight.device)


def test_buffers_of_a_meta_built_module_are_computed_on_the_device_not_left_uninitialised():
    with torch.device("meta"):
        module = _WithTable()
    module = materialize(module, lambda name: torch.bfloat16, "cpu")
    assert module.weight.dtype == torch.bfloat16 and module.weight.device.type == "cpu"
    assert torch.equal(module.table, torch.arange(4.0))


def test_a_module_with_buffers_and_no_init_buffers_is_refused():
    with torch.device("meta"):
        module = torch.nn.BatchNorm1d(4)
    with pytest.raises(TypeError, match="BatchNorm1d registers buffers"):
        materialize(module, lambda name: torch.float32, "cpu")
