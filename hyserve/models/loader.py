"""Checkpoint loading: HF-format directories (sharded safetensors, every spelling of docs/ARCHITECTURE.md §4.7)
and deterministic random weights for the presets, without materialising weights twice."""

from __future__ import annotations

import json
import logging
import os
import re
from collections import defaultdict
from collections.abc import Iterable

import torch
from safetensors import safe_open

from hyserve.models.config import ModelConfig, load_config, parse_config, with_changes
from hyserve.models.deepseek_v32 import DeepseekV32ForCausalLM
from hyserve.models.kimi import KimiForCausalLM
from hyserve.models.presets import PRESETS, preset_config

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "fp32": torch.float32, "bf16": torch.bfloat16, "auto": None}
# parameters held in fp32 whatever the model dtype (docs/ARCHITECTURE.md §4.1)
_FP32_PARAMS = ("A_log", "dt_bias", "conv_weight", "o_norm_weight", "e_score_correction_bias", "gate.weight",
                 "weights_proj.weight")
_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


class CheckpointError(RuntimeError):
    pass


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
    """Allocate the model on `device` without initialising memory (meta first, then to_empty)."""
    with torch.device("meta"):
        model = DeepseekV32ForCausalLM(cfg) if cfg.is_deepseek_v32 else KimiForCausalLM(cfg)
    model = model.to_empty(device=device)
    for name, p in model.named_parameters():
        p.data = p.data.to(torch.float32 if name.endswith(_FP32_PARAMS) else dtype)
    if model.device.type == "cuda":  # give the float32 staging back: the cache planner counts free memory
        torch.cuda.empty_cache()
    log.debug("%s", model.kernel_plan.table())  # decided here, at load: the device and dtype are final
    return model.eval().requires_grad_(False)


def random_init(model: KimiForCausalLM, seed: int = 0, std: float = 0.02) -> None:
    """Deterministic random weights: normal(0, std) for matrices, ones for norms, small gate params."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith(("norm.weight", "o_norm_weight", "res.norm", "attn_res.norm")) or "layernorm" in name:
            p.data.fill_(1.0)
        elif name.endswith("norm.bias"):  # the indexer's k_norm LayerNorm
            p.data.zero_()
        elif name.endswith("A_log"):
            p.data.copy_(torch.log(torch.empty(p.shape).uniform_(1, 16, generator=gen)))
        elif name.endswith("dt_bias"):
            p.data.copy_(torch.empty(p.shape).uniform_(-1.0, 1.0, generator=gen))
        elif name.endswith("conv_weight"):
            p.data.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        elif name.endswith("e_score_correction_bias"):
            p.data.copy_(torch.randn(p.shape, generator=gen) * 0.01)
        else:
            # row-chunked so a 48B model never needs a second full-size fp32 copy
            flat = p.data.view(p.shape[0], -1) if p.dim() > 1 else p.data.view(1, -1)
            for r in range(0, flat.shape[0], 4096):
                chunk = torch.randn(flat[r : r + 4096].shape, generator=gen) * std
                flat[r : r + 4096].copy_(chunk)


def load_model(
    name_or_path: str, dtype: str | torch.dtype | None = None, device: str | torch.device = "cpu", seed: int = 0,
    index_key_format: str | None = None,
) -> KimiForCausalLM:
    """A preset name (random weights) or an HF-format directory (config.json + safetensors).

    `index_key_format` overrides how DSA index keys are cached: "fp8" (default), "mxfp4", or "raw"
    (unquantised, the exact R0 reference of docs/ARCHITECTURE.md §4.4).
    """
    if name_or_path in PRESETS:
        cfg = _with_index_format(parse_config(preset_config(name_or_path)), index_key_format)
        model = build_model(cfg, resolve_dtype(dtype, cfg), device)
        if model.device.type == "cuda" and sum(p.numel() for p in model.parameters()) > DEVICE_DRAW_PARAMS:
            from hyserve.models.device_init import random_init_on_device

            random_init_on_device(model, seed)  # other numbers than the CPU draw, in seconds, not minutes
        else:
            random_init(model, seed)
        model.name_or_path = name_or_path
        return model
    if not os.path.isdir(name_or_path):
        raise CheckpointError(
            f"'{name_or_path}' is neither a preset ({', '.join(sorted(PRESETS))}) nor a model directory"
        )
    cfg = _with_index_format(load_config(name_or_path)[0], index_key_format)
    model = build_model(cfg, resolve_dtype(dtype, cfg), device)
    load_weights(model, name_or_path)
    model.name_or_path = name_or_path
    return model


def _with_index_format(cfg: ModelConfig, fmt: str | None) -> ModelConfig:
    return cfg if fmt is None or not cfg.has_indexer else with_changes(cfg, index_key_format=fmt)


# ---- checkpoint reading ----------------------------------------------------------------------------


def _safetensor_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(path, s) for s in shards]
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    # other safetensors files (e.g. saved activations) may sit beside a model*.safetensors checkpoint
    files = [f for f in files if f.startswith("model")] or files
    if not files:
        raise CheckpointError(f"no .safetensors files in {path}")
    return [os.path.join(path, f) for f in files]


def iter_checkpoint(path: str):
    from tqdm import tqdm

    files = _safetensor_files(path)
    # a large checkpoint takes minutes to read: vLLM's bar, on stderr, when there is more than one shard
    for file in tqdm(files, desc="Loading safetensors checkpoint shards", disable=len(files) <= 1, dynamic_ncols=True):
        with safe_open(file, framework="pt") as f:
            for key in f.keys():
                yield key, f.get_tensor(key)


def dequant_mxfp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """compressed-tensors MXFP4: low nibble = even element, sign bit 3, E8M0 scale per 32 values."""
    lo, hi = packed & 0x0F, packed >> 4
    codes = torch.stack([lo, hi], -1).reshape(packed.shape[0], -1).long()
    mag = _E2M1[codes & 7]
    vals = torch.where(codes & 8 > 0, -mag, mag)
    exp = torch.exp2(scale.float() - 127.0).repeat_interleave(32, dim=1)
    return vals * exp[:, : vals.shape[1]]


_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.*)$")


class _Assembler:
    """Maps checkpoint names onto the model's parameters, stacking experts and conv taps."""

    def __init__(self, model: KimiForCausalLM):
        self.model, self.cfg = model, model.config
        self.params = dict(model.named_parameters())
        self.loaded: set[str] = set()
        self.unexpected: list[str] = []
        self.pending: dict[str, dict] = defaultdict(dict)  # grouped parts (experts, convs, mxfp4)

    def put(self, name: str, t: torch.Tensor) -> None:
        if name not in self.params:
            self.unexpected.append(name)
            return
        p = self.params[name]
        if name.endswith("A_log"):
            t = self._a_log(name, t)
        if name.endswith(("dt_bias", "proj.weight")) and t.dim() == 1 and p.dim() == 2:
            t = t.view_as(p)
        if tuple(t.shape) != tuple(p.shape):
            t = t.reshape(p.shape) if t.numel() == p.numel() and name.endswith(("dt_bias", "conv_weight")) else t
        if tuple(t.shape) != tuple(p.shape):
            raise CheckpointError(f"shape mismatch for {name}: checkpoint {tuple(t.shape)} vs model {tuple(p.shape)}")
        p.data.copy_(t.to(p.dtype))
        self.loaded.add(name)

    def _a_log(self, name: str, t: torch.Tensor) -> torch.Tensor:
        h = self.cfg.kda_num_heads
        flat = t.reshape(-1)
        if flat.numel() < h:
            raise CheckpointError(f"{name} has {flat.numel()} values, fewer than {h} heads")
        if flat.numel() > h and bool((flat[h:] != 0).any()):
            log.warning("%s: entries past the %d heads are not zero; using the first %d", name, h, h)
        return flat[:h]

    def add(self, key: str, t: torch.Tensor) -> None:
        cfg = self.cfg
        if cfg.head_prefix and key.startswith(cfg.head_prefix + "lm_head"):
            key = key[len(cfg.head_prefix) :]
        prefix = cfg.weight_prefix
        if key.startswith(prefix):
            key = "model." + key[len(prefix) :]
        elif key.startswith(("vision_tower.", "multi_modal_projector.", "mm_projector.")):
            return  # the K3 release's MoonViT: not served
        m = _LAYER.match(key)
        if m is None:
            key = re.sub(r"^model\.output_attn_res_(norm|proj)\.weight$", r"model.output_attn_res.\1", key)
            return self.put(key, t)
        i, rest = int(m.group(1)), m.group(2)
        if i >= cfg.num_hidden_layers:
            return  # MTP layers past the decoder are not served
        base = f"model.layers.{i}."
        moe = cfg.mlp_types[i] == "moe"
        if moe and rest.startswith("mlp."):
            rest = "block_sparse_moe." + rest[4:]  # transformers-5 spelling
        elif not moe and rest.startswith("block_sparse_moe."):
            # transformers' save_pretrained reverses its `.block_sparse_moe.` -> `.mlp.` rename on every
            # layer, so the dense layer 0 comes back as `block_sparse_moe.{gate,up,down}_proj`
            rest = "mlp." + rest[len("block_sparse_moe.") :]
        rest = re.sub(r"^(self_attention_res|mlp_res)_(norm|proj)\.weight$", r"\1.\2", rest)
        rest = rest.replace("self_attn.forget_gate.", "self_attn.")
        rest = rest.replace("self_attn.o_norm.weight", "self_attn.o_norm_weight")
        if rest == "self_attn.conv1d.weight":
            return self.put(base + "self_attn.conv_weight", t.reshape(t.shape[0], -1))
        conv = re.match(r"self_attn\.([qkv])_conv1d\.weight$", rest)
        if conv:
            return self._collect(base + "self_attn.conv_weight", conv.group(1), t.reshape(t.shape[0], -1))
        if rest == "block_sparse_moe.experts.gate_up_proj":
            return self.put(base + "block_sparse_moe.w13", t)
        if rest == "block_sparse_moe.experts.down_proj":
            return self.put(base + "block_sparse_moe.w2", t)
        ex = re.match(r"block_sparse_moe\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.(weight|weight_packed|weight_scale)$", rest)
        if ex:
            e, w, kind = int(ex.group(1)), ex.group(2), ex.group(3)
            w = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}.get(w, w)
            return self._collect(base + "block_sparse_moe.experts", (e, w, kind), t)
        self.put(base + rest, t)

    def _collect(self, group: str, part, t: torch.Tensor) -> None:
        self.pending[group][part] = t

    def finish(self) -> None:
        cfg = self.cfg
        for group, parts in self.pending.items():
            if group.endswith("conv_weight"):
                missing = [x for x in "qkv" if x not in parts]
                if missing:
                    raise CheckpointError(f"{group}: missing {', '.join(m + '_conv1d' for m in missing)}")
                self.put(group, torch.cat([parts["q"], parts["k"], parts["v"]], 0))
                continue
            base = group[: -len("experts")]
            mats: dict[tuple[int, str], torch.Tensor] = {}
            for (e, w, kind), t in parts.items():
                if kind == "weight":
                    mats[(e, w)] = t
                elif kind == "weight_packed":
                    if (e, w, "weight_scale") not in parts:
                        raise CheckpointError(f"{base}experts.{e}.{w}: weight_packed without weight_scale")
                    mats[(e, w)] = dequant_mxfp4(t, parts[(e, w, "weight_scale")])
            missing = [f"experts.{e}.{w}" for e in range(cfg.num_experts) for w in ("w1", "w2", "w3") if (e, w) not in mats]
            if missing:
                raise CheckpointError(f"{base}: missing expert weights: {', '.join(missing[:8])}"
                                      + (" ..." if len(missing) > 8 else ""))
            w13 = torch.stack([torch.cat([mats[(e, "w1")], mats[(e, "w3")]], 0) for e in range(cfg.num_experts)])
            self.put(base + "w13", w13)
            self.put(base + "w2", torch.stack([mats[(e, "w2")] for e in range(cfg.num_experts)]))
        missing = sorted(set(self.params) - self.loaded)
        if missing or self.unexpected:
            msg = []
            if missing:
                msg.append(f"missing tensors ({len(missing)}): {', '.join(missing[:12])}" + (" ..." if len(missing) > 12 else ""))
            if self.unexpected:
                msg.append(f"unexpected tensors ({len(self.unexpected)}): {', '.join(self.unexpected[:12])}"
                           + (" ..." if len(self.unexpected) > 12 else ""))
            raise CheckpointError("checkpoint does not match the model: " + "; ".join(msg))


def load_weights(model: KimiForCausalLM, path: str) -> None:
    load_tensors(model, iter_checkpoint(path))


def load_tensors(model: KimiForCausalLM, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Checkpoint-named tensors (HF names, e.g. a transformers model's `state_dict().items()`) into the
    model's parameters, as from a checkpoint directory; raises CheckpointError on missing or extra ones."""
    asm = _Assembler(model)
    transform = getattr(model, "transform_checkpoint", None)  # architecture-specific (DeepSeek V3.2 FP8, rope)
    for key, t in transform(tensors) if transform else tensors:
        asm.add(key, t)
    asm.finish()
