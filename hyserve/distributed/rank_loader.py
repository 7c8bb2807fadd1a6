"""A rank's weights, through the product loader (models/loader.py `load_model(..., parallel=ctx)`):

- from a checkpoint, every tensor is read as this rank's slice: the shard spec of the parameter it fills
  (sharding.py) cut from a safetensors `get_slice` handle, so a rank reads its own part of the files and
  no full tensor passes through its memory. Tensors whose stored layout is not the parameter's (a padded
  A_log, a flat vector) are small: they are read whole, brought into the parameter's layout and cut;
- random weights (presets, load format dummy): every rank draws exactly the numbers the single-device
  model draws, one parameter at a time in its order, and keeps its slice, so a split model computes what
  one process computes.
"""

from __future__ import annotations

import math

import torch

from hyserve.distributed.model import ParallelCausalLM
from hyserve.distributed.sharding import Split, param_specs
from hyserve.models.device_init import random_fill_on_device
from hyserve.models.kimi import KimiForCausalLM
from hyserve.models.loader import DEVICE_DRAW_PARAMS, random_fill
from hyserve.models.weight_assembler import CheckpointError, WeightAssembler


def _shape(t) -> tuple[int, ...]:
    return tuple(t.get_shape()) if hasattr(t, "get_shape") else tuple(t.shape)


def _read(t) -> torch.Tensor:
    """All of a safetensors slice handle (or a tensor as it is)."""
    return t[:] if hasattr(t, "get_shape") else t


def full_shapes(cfg) -> dict[str, tuple[int, ...]]:
    """The single-device model's parameter shapes, in its order (built on the meta device: no memory)."""
    with torch.device("meta"):
        return {n: tuple(p.shape) for n, p in KimiForCausalLM(cfg).named_parameters()}


class RankWeightAssembler(WeightAssembler):
    """The single-device assembler's names and checks (every tensor of the checkpoint accounted for, the
    experts of another rank included), each tensor read as this rank's slice."""

    def __init__(self, model: ParallelCausalLM):
        super().__init__(model)
        self.cfg = model.full_config  # checkpoint names and shapes are the whole model's
        state = model.ctx.state
        self.layout, self.rank = state.config, state.tp.rank
        self.full = full_shapes(self.cfg)
        self.specs = param_specs(self.cfg, self.layout, self.full)
        e, ep = self.cfg.num_experts, self.layout.expert_parallel_size
        self.experts = Split(0, e, ep).owned(self.rank) if ep > 1 else range(e)

    def put(self, name: str, t) -> None:
        if name not in self.params:
            self.unexpected.append(name)
            return
        spec, full, p = self.specs[name], self.full[name], self.params[name]
        stored = _shape(t)
        if isinstance(spec, Split) and math.prod(stored) == math.prod(full) and stored[: spec.dim + 1] == full[: spec.dim + 1]:
            part = spec.take_slice(t, self.rank).reshape(p.shape)  # the split dim means the same: read the slice
        else:
            part = spec.take(self.conform(name, _read(t), full), self.rank)
        self._copy(name, p.data, part)
        self.loaded.add(name)

    def _conv_part(self, name: str, part: str, t) -> None:
        if name in self.params:  # q, k or v taps [P, 1, W]: this rank's channels of the block
            t = self.specs[name].part().take_slice(t, self.rank)
        super()._conv_part(name, part, t)

    def expert_row(self, e: int) -> int | None:
        if not 0 <= e < self.cfg.num_experts:
            return e  # reported as unexpected by the base
        return e - self.experts.start if e in self.experts else None

    def expert_part(self, w: str, kind: str, t) -> torch.Tensor:
        """EP: the whole expert. TP: w1 / w3 [I, D] by rows, w2 [D, I] by columns; MXFP4 codes hold two
        values a byte and scales one per 32 values, so a w2 column split must keep whole scale groups."""
        tp = self.layout.tensor_parallel_size
        if self.layout.expert_parallel_size > 1 or tp == 1:
            return _read(t)
        inter = self.cfg.moe_intermediate_size
        if w != "w2":
            return Split(0, inter, tp).take_slice(t, self.rank)
        if kind != "weight" and (inter // tp) % 32:
            raise CheckpointError(f"MXFP4 w2 columns {inter} / tensor_parallel_size {tp} is not a multiple of 32 "
                                  "(one scale group): this checkpoint cannot be split that way")
        cols = {"weight": inter, "weight_packed": inter // 2, "weight_scale": inter // 32}[kind]
        return Split(1, cols, tp).take_slice(t, self.rank)


@torch.no_grad()
def random_rank_weights(model: ParallelCausalLM, seed: int, std: float = 0.02) -> None:
    """The single-device model's random weights (`loader.random_init`, or its on-device draw for presets
    above DEVICE_DRAW_PARAMS on a GPU), drawn whole one parameter at a time, this rank's slice kept."""
    cfg, rank = model.full_config, model.ctx.state.tp.rank
    shapes = full_shapes(cfg)
    params = dict(model.named_parameters())
    specs = param_specs(cfg, model.ctx.state.config, shapes)
    on_device = model.device.type == "cuda" and sum(map(math.prod, shapes.values())) > DEVICE_DRAW_PARAMS
    gen = torch.Generator(device=model.device if on_device else "cpu").manual_seed(seed)
    for name, shape in shapes.items():
        p = params[name]
        whole = torch.empty(shape, dtype=p.dtype, device=p.device if on_device else "cpu")
        (random_fill_on_device if on_device else random_fill)(name, whole, gen, std)
        p.data.copy_(specs[name].take(whole, rank))
