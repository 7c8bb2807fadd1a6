"""Models from a preset name or an HF-format directory, parameters allocated once in their target dtype on
their target device. `load_format` follows vLLM: `safetensors` streams the shards tensor by tensor
(weight_files.py), `fastsafetensors` reads each shard straight into device memory, `dummy` draws random
weights at the config's shape (what the presets do), `auto` is safetensors for a directory and dummy for
a preset. The start-up log gets the time, the rate and the memory it took (load_report.py)."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable

import torch

from hyserve.config import LOAD_FORMATS
from hyserve.models.config import ModelConfig, load_config, parse_config, with_changes
from hyserve.models.deepseek_v32 import DeepseekV32ForCausalLM
from hyserve.models.device_init import materialize
from hyserve.models.kimi import KimiForCausalLM
from hyserve.models.load_report import LoadMeter
from hyserve.models.presets import PRESETS, preset_config
from hyserve.models.weight_assembler import CheckpointError, WeightAssembler, dequant_mxfp4
from hyserve.models.weight_files import iter_tensors, safetensor_files

log = logging.getLogger(__name__)

__all__ = ["LOAD_FORMATS", "CheckpointError", "build_model", "dequant_mxfp4", "iter_checkpoint", "load_model",
           "load_tensors", "load_weights", "random_fill", "random_init", "read_model_config", "resolve_dtype",
           "resolve_load_format"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "fp32": torch.float32, "bf16": torch.bfloat16, "auto": None}
# parameters held in fp32 whatever the model dtype (docs/ARCHITECTURE.md §4.1)
_FP32_PARAMS = ("A_log", "dt_bias", "conv_weight", "o_norm_weight", "e_score_correction_bias", "gate.weight",
                "weights_proj.weight")


def resolve_dtype(dtype: str | torch.dtype | None, cfg: ModelConfig) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        dtype = cfg.dtype
    if dtype not in _DTYPES or _DTYPES[dtype] is None:
        raise ValueError(f"unsupported dtype '{dtype}' (use float32 or bfloat16)")
    return _DTYPES[dtype]


# presets larger than this draw their random weights on the GPU they are built on (a CPU draw of the
# 22B k3.1-mini takes minutes); smaller ones draw the same numbers on every device, so tests can compare
DEVICE_DRAW_PARAMS = 2_000_000_000


def build_model(cfg: ModelConfig, dtype: torch.dtype, device: str | torch.device) -> KimiForCausalLM:
    """The model on `device`, parameters uninitialised, each allocated once in its final dtype."""
    with torch.device("meta"):
        model = DeepseekV32ForCausalLM(cfg) if cfg.is_deepseek_v32 else KimiForCausalLM(cfg)
    model = materialize(model, lambda name: torch.float32 if name.endswith(_FP32_PARAMS) else dtype, device)
    log.debug("%s", model.kernel_plan.table())  # decided here, at load: the device and dtype are final
    return model.eval().requires_grad_(False)


def random_init(model: KimiForCausalLM, seed: int = 0, std: float = 0.02) -> None:
    """Deterministic random weights: normal(0, std) for matrices, ones for norms, small gate params."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    for name, p in model.named_parameters():
        random_fill(name, p.data, gen, std)


def random_fill(name: str, data: torch.Tensor, gen: torch.Generator, std: float = 0.02) -> None:
    """Parameter `name`'s random values drawn from the CPU generator `gen` into `data`: the same numbers
    for the same sequence of names and shapes, whatever `data`'s dtype and device."""
    if name.endswith(("norm.weight", "o_norm_weight", "res.norm", "attn_res.norm")) or "layernorm" in name:
        data.fill_(1.0)
    elif name.endswith("norm.bias"):  # the indexer's k_norm LayerNorm
        data.zero_()
    elif name.endswith("A_log"):
        data.copy_(torch.log(torch.empty(data.shape).uniform_(1, 16, generator=gen)))
    elif name.endswith("dt_bias"):
        data.copy_(torch.empty(data.shape).uniform_(-1.0, 1.0, generator=gen))
    elif name.endswith("conv_weight"):
        data.copy_(torch.randn(data.shape, generator=gen) * 0.3)
    elif name.endswith("e_score_correction_bias"):
        data.copy_(torch.randn(data.shape, generator=gen) * 0.01)
    else:
        # row-chunked so a 48B model never needs a second full-size fp32 copy
        flat = data.view(data.shape[0], -1) if data.dim() > 1 else data.view(1, -1)
        for r in range(0, flat.shape[0], 4096):
            chunk = torch.randn(flat[r : r + 4096].shape, generator=gen) * std
            flat[r : r + 4096].copy_(chunk)


def resolve_load_format(name_or_path: str, load_format: str = "auto") -> str:
    """The concrete format for `name_or_path`; ValueError / CheckpointError where it cannot apply."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unknown load format '{load_format}' (choose from {', '.join(LOAD_FORMATS)})")
    if name_or_path in PRESETS:
        if load_format not in ("auto", "dummy"):
            raise CheckpointError(f"'{name_or_path}' is a preset: it has no weight files to read with "
                                  f"load format {load_format} (use auto or dummy)")
        return "dummy"
    if not os.path.isdir(name_or_path):
        raise CheckpointError(
            f"'{name_or_path}' is neither a preset ({', '.join(sorted(PRESETS))}) nor a model directory"
        )
    return "safetensors" if load_format == "auto" else load_format


def read_model_config(name_or_path: str, load_format: str = "auto") -> ModelConfig:
    """The ModelConfig of a preset or a model directory (nothing else read); errors as `load_model`'s."""
    resolve_load_format(name_or_path, load_format)
    return parse_config(preset_config(name_or_path)) if name_or_path in PRESETS else load_config(name_or_path)[0]


def load_model(
    name_or_path: str, dtype: str | torch.dtype | None = None, device: str | torch.device = "cpu", seed: int = 0,
    index_key_format: str | None = None, load_format: str = "auto", parallel=None,
) -> KimiForCausalLM:
    """A preset name or an HF-format directory (config.json + safetensors) read with `load_format`.

    `index_key_format` overrides how DSA index keys are cached: "fp8" (default), "mxfp4", or "raw"
    (unquantised, the exact R0 reference of docs/ARCHITECTURE.md §4.4). The model's `load_report` says what loading cost.
    `parallel` (a rank's `distributed.context.StepContext`): that rank's model, each checkpoint tensor read as
    its slice, random weights drawn as the single-device model's and cut (distributed/rank_loader.py).
    """
    fmt = resolve_load_format(name_or_path, load_format)
    cfg = _with_index_format(read_model_config(name_or_path), index_key_format)
    files = [] if fmt == "dummy" else safetensor_files(name_or_path)
    dt = resolve_dtype(dtype, cfg)
    if parallel is None:
        model = build_model(cfg, dt, device)
    else:
        from hyserve.distributed.model import build_rank_model

        model = build_rank_model(cfg, parallel, device, lambda name: torch.float32 if name.endswith(_FP32_PARAMS) else dt)
    with LoadMeter(model, fmt, [os.path.getsize(f) for f in files]) as meter:
        if fmt == "dummy":
            _random_weights(model, seed)
        else:
            load_tensors(model, iter_tensors(files, fmt, model.device, slices=parallel is not None))
    if model.device.type == "cuda":
        torch.cuda.empty_cache()  # conversion temporaries: the cache planner sizes the pool from free memory
    model.name_or_path = name_or_path
    model.load_report = meter.report
    log.info(meter.report.describe())
    return model


def _random_weights(model: KimiForCausalLM, seed: int) -> None:
    if hasattr(model, "full_config"):  # a rank's model
        from hyserve.distributed.rank_loader import random_rank_weights

        return random_rank_weights(model, seed)
    if model.device.type == "cuda" and sum(p.numel() for p in model.parameters()) > DEVICE_DRAW_PARAMS:
        from hyserve.models.device_init import random_init_on_device

        random_init_on_device(model, seed)  # other numbers than the CPU draw, in seconds, not minutes
    else:
        random_init(model, seed)


def _with_index_format(cfg: ModelConfig, fmt: str | None) -> ModelConfig:
    return cfg if fmt is None or not cfg.has_indexer else with_changes(cfg, index_key_format=fmt)


def iter_checkpoint(path: str, load_format: str = "safetensors", device: str | torch.device = "cpu"):
    """(checkpoint name, tensor) for every tensor of the directory's shards, one at a time."""
    return iter_tensors(safetensor_files(path), load_format, device)


def load_weights(model: KimiForCausalLM, path: str, load_format: str = "safetensors") -> None:
    load_tensors(model, iter_checkpoint(path, load_format, model.device))


def load_tensors(model: KimiForCausalLM, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Checkpoint-named tensors (HF names, e.g. a transformers model's `state_dict().items()`) into the
    model's parameters, as from a checkpoint directory; raises CheckpointError on missing or extra ones."""
    if hasattr(model, "full_config"):  # a rank's model: each tensor read as its slice
        from hyserve.distributed.rank_loader import RankWeightAssembler

        asm = RankWeightAssembler(model)
    else:
        asm = WeightAssembler(model)
    transform = getattr(model, "transform_checkpoint", None)  # architecture-specific (DeepSeek V3.2 FP8, rope)
    with torch.no_grad():
        for key, t in transform(tensors) if transform else tensors:
            asm.add(key, t)
            # a safetensors tensor keeps its whole shard mapped: let it go before the next shard opens
            del t
    asm.finish()
