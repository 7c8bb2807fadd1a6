"""Which slice of each parameter a rank holds: a spec per parameter name, from the model config and the
layout alone, so the loader can read only a rank's slices (`take_slice` on a safetensors `get_slice`).

TP (docs/parallelism.md): heads, intermediate widths and vocab rows are split; MLA's latent path
(q_a, kv_a, their norms), KDA's rank-K gate inputs (f_a, g_a), the output norm, the DSA indexer, routers,
norms and AttnRes are replicated. With expert parallelism the routed experts are split by expert and the
rest of the MoE block (router, latent projections, shared experts) is replicated.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from hyserve.distributed.config import ParallelConfig
from hyserve.models.config import ModelConfig


@dataclass(frozen=True)
class Replicated:
    """Every rank holds the whole tensor."""

    def local_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(shape)

    def take(self, t: torch.Tensor, rank: int) -> torch.Tensor:
        return t

    def take_slice(self, sl, rank: int) -> torch.Tensor:
        return sl[:]


@dataclass(frozen=True)
class Split:
    """Dim `dim` (logical length `size`) holds `groups` equal blocks (q|k|v conv taps, gate|up rows),
    each cut into `parts` equal pieces; a rank holds its piece of every block, concatenated. With
    `pad` (vocab rows) each rank holds ceil(size / parts) rows, the last rank's tail zero-filled.
    Slices are cut from `size`, not from the stored length: a padded checkpoint tensor (K3's A_log)
    reads correctly."""

    dim: int
    size: int
    parts: int
    groups: int = 1
    pad: bool = False

    @property
    def rows(self) -> int:
        """The rank's length along `dim` (padding included)."""
        return math.ceil(self.size / self.parts) if self.pad else self.size // self.parts

    def ranges(self, rank: int) -> list[tuple[int, int]]:
        """[start, stop) along dim of each piece this rank reads, in order."""
        if self.pad:
            return [(min(self.size, rank * self.rows), min(self.size, (rank + 1) * self.rows))]
        block = self.size // self.groups
        piece = block // self.parts
        return [(g * block + rank * piece, g * block + (rank + 1) * piece) for g in range(self.groups)]

    def local_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(self.rows if d == self.dim else n for d, n in enumerate(shape))

    def _assemble(self, pieces: list[torch.Tensor]) -> torch.Tensor:
        t = torch.cat(pieces, self.dim) if len(pieces) > 1 else pieces[0]
        short = self.rows - t.shape[self.dim]
        if short:
            fill = list(t.shape)
            fill[self.dim] = short
            t = torch.cat([t, t.new_zeros(fill)], self.dim)
        return t.contiguous()

    def take(self, t: torch.Tensor, rank: int) -> torch.Tensor:
        return self._assemble([t.narrow(self.dim, a, b - a) for a, b in self.ranges(rank)])

    def take_slice(self, sl, rank: int) -> torch.Tensor:
        """This rank's part of a safetensors slice (`safe_open(...).get_slice(name)`): reads only it."""
        lead = (slice(None),) * self.dim
        return self._assemble([sl[(*lead, slice(a, b))] for a, b in self.ranges(rank)])

    def part(self) -> Split:
        """The spec of one block read as its own tensor (the loader's q_conv1d, or an expert's w1)."""
        return Split(self.dim, self.size // self.groups, self.parts)

    def owned(self, rank: int) -> range:
        """The indices along dim this rank holds (for an expert split: its experts)."""
        if self.groups != 1:
            raise ValueError("owned() is for a split of one block")
        a, b = self.ranges(rank)[0]
        return range(a, b)


Spec = Replicated | Split

_REPLICATED = re.compile(
    r"(norm\.weight|layernorm\.weight|_res\.(proj|norm)|attn_res\.(proj|norm)|o_norm_weight|f_a_proj\.weight|"
    r"g_a_proj\.weight|q_a_proj\.weight|kv_a_proj_with_mqa\.weight|indexer\..*|gate\.weight|"
    r"gate\.e_score_correction_bias|routed_expert_down_proj\.weight)$"
)


def _attention_spec(cfg: ModelConfig, kind: str, leaf: str, tp: int) -> Spec | None:
    if kind == "kda":
        h, p = cfg.kda_num_heads, cfg.kda_proj_dim
        rows = {"q_proj.weight": p, "k_proj.weight": p, "v_proj.weight": p, "f_b_proj.weight": p,
                "g_b_proj.weight": p, "g_proj.weight": p, "dt_bias": p, "b_proj.weight": h, "A_log": h}
        if leaf == "conv_weight":
            return Split(0, 3 * p, tp, groups=3)
        if leaf == "o_proj.weight":
            return Split(1, p, tp)
    else:
        h = cfg.num_attention_heads
        rows = {"q_proj.weight": h * cfg.qk_head_dim, "q_b_proj.weight": h * cfg.qk_head_dim,
                "kv_b_proj.weight": h * (cfg.qk_nope_head_dim + cfg.v_head_dim), "g_proj.weight": h * cfg.v_head_dim}
        if leaf == "o_proj.weight":
            return Split(1, h * cfg.v_head_dim, tp)
    return Split(0, rows[leaf], tp) if leaf in rows else None


def _moe_spec(cfg: ModelConfig, leaf: str, p: ParallelConfig) -> Spec | None:
    tp, inter = p.tensor_parallel_size, cfg.moe_intermediate_size
    if p.expert_parallel_size > 1:
        if leaf in ("w13", "w2"):
            return Split(0, cfg.num_experts, p.expert_parallel_size)
        if leaf.startswith(("shared_experts.", "routed_expert_")):
            return Replicated()
        return None
    shared = inter * cfg.num_shared_experts
    specs = {"w13": Split(1, 2 * inter, tp, groups=2), "w2": Split(2, inter, tp),
             "shared_experts.gate_proj.weight": Split(0, shared, tp), "shared_experts.up_proj.weight": Split(0, shared, tp),
             "shared_experts.down_proj.weight": Split(1, shared, tp),
             "routed_expert_up_proj.weight": Split(0, cfg.hidden_size, tp)}
    return specs.get(leaf)


def param_spec(cfg: ModelConfig, p: ParallelConfig, name: str) -> Spec:
    """The spec of the single-device model's parameter `name`; KeyError for a name it does not know
    (a new parameter must be given a rule, not replicated by accident)."""
    tp = p.tensor_parallel_size
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return Split(0, cfg.vocab_size, tp, pad=True)
    m = re.match(r"model\.layers\.(\d+)\.(self_attn|mlp|block_sparse_moe)\.(.+)$", name)
    spec: Spec | None = None
    if m is not None:
        i, part, leaf = int(m.group(1)), m.group(2), m.group(3)
        if part == "self_attn":
            spec = _attention_spec(cfg, cfg.layer_types[i], leaf, tp)
        elif part == "mlp" and leaf in ("gate_proj.weight", "up_proj.weight", "down_proj.weight"):
            spec = Split(1 if leaf == "down_proj.weight" else 0, cfg.intermediate_size, tp)
        elif part == "block_sparse_moe":
            spec = _moe_spec(cfg, leaf, p)
    if spec is None and _REPLICATED.search(name):
        spec = Replicated()
    if spec is None:
        raise KeyError(f"no sharding rule for parameter '{name}'")
    return spec


def param_specs(cfg: ModelConfig, p: ParallelConfig, names) -> dict[str, Spec]:
    return {n: param_spec(cfg, p, n) for n in names}
