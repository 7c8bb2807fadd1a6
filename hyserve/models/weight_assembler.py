"""Checkpoint tensors, one at a time, into the model's parameters: every spelling of docs/ARCHITECTURE.md §4.7 mapped
onto hyserve's names, per-expert matrices and per-channel convolution taps written straight into their
slice of the stacked parameter, so nothing waits for the rest of a group in host memory. Only the two
halves of an MXFP4 expert matrix (codes and scales) wait for each other."""

from __future__ import annotations

import logging
import math
import re
from collections import defaultdict

import torch

log = logging.getLogger(__name__)

_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.*)$")
_EXPERT = re.compile(r"block_sparse_moe\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\."
                     r"(weight|weight_packed|weight_scale)$")
_EXPERT_PART = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


class CheckpointError(RuntimeError):
    pass


def dequant_mxfp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """compressed-tensors MXFP4: low nibble = even element, sign bit 3, E8M0 scale per 32 values."""
    lo, hi = packed & 0x0F, packed >> 4
    codes = torch.stack([lo, hi], -1).reshape(packed.shape[0], -1).long()
    mag = _E2M1.to(packed.device)[codes & 7]
    vals = torch.where(codes & 8 > 0, -mag, mag)
    exp = torch.exp2(scale.float() - 127.0).repeat_interleave(32, dim=1)
    return vals * exp[:, : vals.shape[1]]


def _names(items: list[str], limit: int = 12) -> str:
    return ", ".join(items[:limit]) + (" ..." if len(items) > limit else "")


class WeightAssembler:
    """`add(checkpoint_name, tensor)` for every tensor, then `finish()` (raises on missing or extra ones)."""

    def __init__(self, model: torch.nn.Module):
        self.cfg = model.config
        self.params = dict(model.named_parameters())
        self.loaded: set[str] = set()
        self.unexpected: list[str] = []
        self.parts: dict[str, set] = defaultdict(set)  # stacked parameter group -> parts written so far
        self.halves: dict[tuple[str, int, str], dict[str, torch.Tensor]] = {}  # MXFP4 codes / scales

    # ---- whole parameters -----------------------------------------------------------------------
    def put(self, name: str, t: torch.Tensor) -> None:
        if name not in self.params:
            self.unexpected.append(name)
            return
        p = self.params[name]
        self._copy(name, p.data, self.conform(name, t, tuple(p.shape)))
        self.loaded.add(name)

    def conform(self, name: str, t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        """A checkpoint tensor in the layout of parameter `name` of `shape` (padded A_log cut to the heads,
        flat vectors and conv taps reshaped)."""
        if name.endswith("A_log"):
            t = self._a_log(name, t)
        if name.endswith(("dt_bias", "proj.weight")) and t.dim() == 1 and len(shape) == 2:
            t = t.view(shape)
        if tuple(t.shape) != shape and t.numel() == math.prod(shape) and name.endswith(("dt_bias", "conv_weight")):
            t = t.reshape(shape)
        return t

    @staticmethod
    def _copy(name: str, dst: torch.Tensor, t: torch.Tensor) -> None:
        if tuple(t.shape) != tuple(dst.shape):
            raise CheckpointError(f"shape mismatch for {name}: checkpoint {tuple(t.shape)} vs model {tuple(dst.shape)}")
        dst.copy_(t)  # converts dtype and device on the way: no full-precision copy of the tensor

    def _a_log(self, name: str, t: torch.Tensor) -> torch.Tensor:
        h = self.cfg.kda_num_heads
        flat = t.reshape(-1)
        if flat.numel() < h:
            raise CheckpointError(f"{name} has {flat.numel()} values, fewer than {h} heads")
        if flat.numel() > h and bool((flat[h:] != 0).any()):
            log.warning("%s: entries past the %d heads are not zero; using the first %d", name, h, h)
        return flat[:h]

    # ---- names ----------------------------------------------------------------------------------
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
        self._add_layer(f"model.layers.{i}.", cfg.mlp_types[i] == "moe", rest, t)

    def _add_layer(self, base: str, moe: bool, rest: str, t: torch.Tensor) -> None:
        if moe and rest.startswith("mlp."):
            rest = "block_sparse_moe." + rest[4:]  # transformers-5 spelling
        elif not moe and rest.startswith("block_sparse_moe."):
            # transformers' save_pretrained reverses its `.block_sparse_moe.` -> `.mlp.` rename on every
            # layer, so the dense layer 0 comes back as `block_sparse_moe.{gate,up,down}_proj`
            rest = "mlp." + rest[len("block_sparse_moe.") :]
        rest = re.sub(r"^(self_attention_res|mlp_res)_(norm|proj)\.weight$", r"\1.\2", rest)
        rest = rest.replace("self_attn.forget_gate.", "self_attn.")
        rest = rest.replace("self_attn.o_norm.weight", "self_attn.o_norm_weight")
        if rest == "self_attn.conv1d.weight":  # [3P, 1, W] or [3P, W]: conform reshapes it
            return self.put(base + "self_attn.conv_weight", t)
        conv = re.match(r"self_attn\.([qkv])_conv1d\.weight$", rest)
        if conv:
            return self._conv_part(base + "self_attn.conv_weight", conv.group(1), t)
        if rest == "block_sparse_moe.experts.gate_up_proj":
            return self.put(base + "block_sparse_moe.w13", t)
        if rest == "block_sparse_moe.experts.down_proj":
            return self.put(base + "block_sparse_moe.w2", t)
        ex = _EXPERT.match(rest)
        if ex:
            w = _EXPERT_PART.get(ex.group(2), ex.group(2))
            return self._expert(base + "block_sparse_moe.", int(ex.group(1)), w, ex.group(3), t)
        self.put(base + rest, t)

    # ---- slices of stacked parameters -------------------------------------------------------------
    def _conv_part(self, name: str, part: str, t: torch.Tensor) -> None:
        if name not in self.params:
            self.unexpected.append(name.replace("conv_weight", f"{part}_conv1d.weight"))
            return
        rows = self.params[name].shape[0] // 3  # P (a rank's P / TP)
        j = "qkv".index(part)
        self._copy(f"{name} ({part})", self.params[name].data[j * rows : (j + 1) * rows], t.reshape(t.shape[0], -1))
        self.parts[name].add(part)

    def _expert(self, base: str, e: int, w: str, kind: str, t: torch.Tensor) -> None:
        row = self.expert_row(e)
        if row is None:  # another rank's expert (distributed/rank_loader.py): not read here
            self.parts[base + "experts"].add((e, w))
            return
        t = self.expert_part(w, kind, t)
        if kind != "weight":
            half = self.halves.setdefault((base, e, w), {})
            half[kind] = t
            if len(half) < 2:
                return
            del self.halves[(base, e, w)]
            t = dequant_mxfp4(half["weight_packed"], half["weight_scale"])
        name = f"{base}experts.{e}.{w}.weight"
        if base + "w13" not in self.params or e >= self.cfg.num_experts:
            self.unexpected.append(name)
            return
        w13 = self.params[base + "w13"].data
        inter = w13.shape[1] // 2
        dst = {"w1": w13[row, :inter], "w3": w13[row, inter:], "w2": self.params[base + "w2"].data[row]}[w]
        self._copy(name, dst, t)
        self.parts[base + "experts"].add((e, w))

    def expert_row(self, e: int) -> int | None:
        """Where expert e sits in the stacked w13 / w2, None when this model does not hold it."""
        return e

    def expert_part(self, w: str, kind: str, t: torch.Tensor) -> torch.Tensor:
        """The part of an expert's checkpoint tensor (w1, w2 or w3; weight, weight_packed or weight_scale)
        this model holds: all of it."""
        return t

    # ---- the end ----------------------------------------------------------------------------------
    def finish(self) -> None:
        problems = [f"{base}experts.{e}.{w}: weight_packed without weight_scale" if "weight_packed" in half
                    else f"{base}experts.{e}.{w}: weight_scale without weight_packed"
                    for (base, e, w), half in self.halves.items()]
        for group, parts in self.parts.items():
            if group.endswith("conv_weight"):
                missing = [x + "_conv1d" for x in "qkv" if x not in parts]
                if missing:
                    problems.append(f"{group}: missing {', '.join(missing)}")
                else:
                    self.loaded.add(group)
                continue
            base = group[: -len("experts")]
            missing = [f"experts.{e}.{w}" for e in range(self.cfg.num_experts) for w in ("w1", "w2", "w3")
                       if (e, w) not in parts]
            if missing:
                problems.append(f"{base}: missing expert weights: {_names(missing, 8)}")
            else:
                self.loaded.update((base + "w13", base + "w2"))
        if problems:
            raise CheckpointError("; ".join(problems))
        missing = sorted(set(self.params) - self.loaded)
        msg = []
        if missing:
            msg.append(f"missing tensors ({len(missing)}): {_names(missing)}")
        if self.unexpected:
            msg.append(f"unexpected tensors ({len(self.unexpected)}): {_names(self.unexpected)}")
        if msg:
            raise CheckpointError("checkpoint does not match the model: " + "; ".join(msg))
