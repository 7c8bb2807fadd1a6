"""MLA under decode context parallelism: TP's head split plus the latent cache (and the DSA index keys)
split by token over the DCP group (dcp.py, dsa_dcp.py). The rows and keys of a step's tokens are computed
on every rank (the projections are replicated) and stored by their owner only."""

from __future__ import annotations

import torch

from hyserve.distributed.context import StepContext
from hyserve.distributed.dcp import TokenOwnership, dcp_mla, write_owned
from hyserve.distributed.dsa_dcp import dcp_index_topk, dcp_sparse_mla
from hyserve.distributed.tp_layers import TPMLAttention
from hyserve.models.batch import Batch, CacheTensors
from hyserve.models.config import ModelConfig
from hyserve.ops.kernel_plan import KernelPlan, active


class DCPMLAttention(TPMLAttention):
    def __init__(self, local_cfg: ModelConfig, mla_index: int, ctx: StepContext):
        super().__init__(local_cfg, mla_index, ctx)
        if self.rotary is not None:
            raise NotImplementedError("DCP is built for the NoPE Kimi MLA; rotary MLA (DeepSeek V3.2) is not split yet")
        g = ctx.state.dcp
        self.own = TokenOwnership(g.size, g.rank, ctx.state.config.cp_kv_cache_interleave_size)

    def forward(self, x: torch.Tensor, batch: Batch, cache: CacheTensors, plan: KernelPlan | None = None) -> torch.Tensor:
        """The attention itself is torch code under DCP (docs/parallelism.md); `plan` picks the output
        projection's kernel."""
        x = self.ctx.gather_input(x)
        group, layer = self.ctx.state.dcp, self.mla_index
        slots = self.own.slot_mapping(batch, cache.block_size)
        q_lat = self.q_a_layernorm(self.q_a_proj(x)) if self.indexer is not None else None
        q = self.query(x, q_lat)
        q_nope, q_rope = q[..., : self.dn], q[..., self.dn :]
        write_owned(cache.pages, layer, slots, self.cache_rows(x))
        w, args = self.kv_b_proj.weight, (self.own, group, self.rank, self.dv, self.scale)
        if self.indexer is not None:
            selected = dcp_index_topk(self.indexer, x, q_lat, batch, cache, self.own, slots, group)
            o = dcp_sparse_mla(q_nope, q_rope, w, cache.pages, layer, batch, selected, *args)
        else:
            o = dcp_mla(q_nope, q_rope, w, cache.pages, layer, batch, *args)
        return self.ctx.reduce(self.project_out(o, x, active(plan)))
