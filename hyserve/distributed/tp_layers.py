"""Tensor-parallel layers: the single-device layers built at a rank's shapes (heads / TP, widths / TP),
plus the communication around them. Column-parallel inputs (q/k/v, gates, up projections) need no
communication; the row-parallel output projection sums over ranks with one all-reduce, or under
sequence parallelism one reduce-scatter after an all-gather of the input tokens."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hyserve.distributed.context import StepContext
from hyserve.models.batch import Batch, CacheTensors
from hyserve.models.config import ModelConfig
from hyserve.models.layers.activation import GLU
from hyserve.models.layers.kda import KimiDeltaAttention
from hyserve.models.layers.mla import MLAttention
from hyserve.models.layers.moe import DenseMLP
from hyserve.ops.dense_gemv import linear
from hyserve.ops.kernel_plan import KernelPlan, active


class VocabParallelEmbedding(nn.Embedding):
    """Rows [start, start + rows) of the vocabulary; a token outside them embeds to zero here, so the
    sum over ranks (exact: one nonzero term) is the embedding."""

    def __init__(self, rows: int, dim: int, start: int, vocab_size: int, ctx: StepContext):
        super().__init__(rows, dim)
        self.start, self.stop, self.ctx = start, min(vocab_size, start + rows), ctx

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mine = (ids >= self.start) & (ids < self.stop)
        local = torch.where(mine, ids - self.start, 0)
        y = F.embedding(local, self.weight).masked_fill(~mine[:, None], 0)
        return self.ctx.reduce(y)


class _RowParallelAttention:
    """An attention layer at a rank's head count: column-parallel projections in, the output
    projection's partial sum reduced over the ranks (under SP: the step's tokens gathered first)."""

    def __init__(self, local_cfg: ModelConfig, layer_index: int, ctx: StepContext):
        super().__init__(local_cfg, layer_index)
        self.ctx = ctx

    def forward(self, x: torch.Tensor, batch: Batch, cache: CacheTensors, plan: KernelPlan | None = None) -> torch.Tensor:
        return self.ctx.reduce(super().forward(self.ctx.gather_input(x), batch, cache, plan))


class TPKimiDeltaAttention(_RowParallelAttention, KimiDeltaAttention):
    """KDA with this rank's heads: its q/k/v, conv channels, gate rows, A_log and dt_bias entries, and
    o_proj columns; its state slots hold only its heads."""


class TPMLAttention(_RowParallelAttention, MLAttention):
    """MLA with this rank's query heads (q_b / q_proj rows, kv_b rows, g_proj rows, o_proj columns); the
    latent (q_a, kv_a, the cache rows) and the DSA indexer are replicated: every rank writes the same
    rows into its own cache."""


class TPDenseMLP(DenseMLP):
    """gate/up column-parallel, down row-parallel: one all-reduce (or reduce-scatter) per call."""

    def __init__(self, dim: int, local_inter: int, act: GLU, ctx: StepContext):
        super().__init__(dim, local_inter, act)
        self.ctx = ctx

    def forward(self, x: torch.Tensor, plan: KernelPlan | None = None) -> torch.Tensor:
        return self.ctx.reduce(super().forward(self.ctx.gather_input(x), plan))


def vocab_parallel_logits(hidden: torch.Tensor, head_rows: torch.Tensor, vocab_size: int, ctx: StepContext,
                          plan: KernelPlan | None = None) -> torch.Tensor:
    """fp32 logits [T, vocab]: this rank's head rows (the GEMV `plan` gives one token), then one all-gather
    along the vocabulary."""
    local = linear(hidden, head_rows, config=active(plan).linear_gemv(hidden, head_rows)).float()
    return ctx.state.tp.all_gather(local, dim=-1)[:, :vocab_size]
