"""The MoE block of one rank, tensor- or expert-parallel.

TP: every rank routes all tokens (the router is replicated) and runs every expert on its slice of the
intermediate width, so its expert output is a partial sum. Kimi Linear's MoE then needs one all-reduce
(routed + shared partials together). K3's LatentMoE needs the full latent before its norm, so (the
reference deployment's tail): all-reduce the latent, norm, the up-projection column-parallel (this
rank's slice of the hidden columns), plus the shared experts' partial reduce-scattered to the same
columns, then one all-gather of the columns.

EP: routed experts split by expert, dispatched by all-to-all (ep.py); router, latent projections and
shared experts replicated. With replicated tokens each rank dispatches its chunk and the chunks'
outputs are all-gathered; the block's output is then bit-identical to the single-device block in fp32
(every replicated GEMM sees the whole batch, as there). Under sequence parallelism each rank's token
shard is its chunk and the output stays sharded.
"""

from __future__ import annotations

import torch
from torch import nn

from hyserve.distributed.context import StepContext
from hyserve.distributed.ep import ep_experts_forward, local_experts_forward
from hyserve.models.config import ModelConfig, with_changes
from hyserve.models.layers.moe import MoE
from hyserve.ops.kernel_plan import KernelPlan, active


class ParallelMoE(MoE):
    def __init__(self, cfg: ModelConfig, ctx: StepContext):
        p, tp = ctx.state.config, ctx.state.tp.size
        self.expert_parallel = ctx.state.ep.size > 1
        local = cfg if self.expert_parallel else with_changes(cfg, moe_intermediate_size=cfg.moe_intermediate_size // tp)
        super().__init__(local)
        self.ctx = ctx
        if self.expert_parallel:
            e = cfg.num_experts // p.expert_parallel_size
            self.w13 = nn.Parameter(torch.zeros(e, *self.w13.shape[1:]))
            self.w2 = nn.Parameter(torch.zeros(e, *self.w2.shape[1:]))
        elif self.latent:
            self.routed_expert_up_proj = nn.Linear(cfg.latent_moe_dim, cfg.hidden_size // tp, bias=False)

    def forward(self, x: torch.Tensor, summed: bool = True, plan: KernelPlan | None = None) -> torch.Tensor:
        """`MoE.forward`'s contract with the kernels `plan` picks; always summed (the block's output is
        reduced or gathered over the ranks, so the decode kernels' unsummed pairs cannot leave it)."""
        plan = active(plan)
        return self._forward_ep(x, plan) if self.expert_parallel else self._forward_tp(x, plan)

    def _latent_in(self, x: torch.Tensor) -> torch.Tensor:
        return self.routed_expert_down_proj(x) if self.latent else x

    def _forward_tp(self, x: torch.Tensor, plan: KernelPlan) -> torch.Tensor:
        ctx, tp = self.ctx, self.ctx.state.tp
        full = ctx.gather_input(x)
        ids, w = self.gate(full, plan)
        y = local_experts_forward(self._latent_in(full), ids, w, self.w13, self.w2, self.act, plan)
        if not self.latent:
            if self.shared_experts is not None:
                y = y + self.shared_experts(full, plan)
            out = tp.all_reduce(y)
        else:
            y = tp.all_reduce(y)
            if self.routed_expert_norm is not None:
                y = self.routed_expert_norm(y)
            y = self.routed_expert_up_proj(y)  # [T, D / TP]: this rank's columns
            if self.shared_experts is not None:
                y = y + tp.reduce_scatter(self.shared_experts(full, plan), dim=-1)
            out = tp.all_gather(y, dim=-1)
        return ctx.own_shard(out) if ctx.sequence_parallel else out

    def _forward_ep(self, x: torch.Tensor, plan: KernelPlan) -> torch.Tensor:
        ctx = self.ctx
        ids, w = self.gate(x, plan)
        xe = self._latent_in(x)
        a, b = ctx.token_range()
        if ctx.sequence_parallel:  # x is this rank's shard: its real rows come first
            a, b = 0, b - a
        y = ep_experts_forward(xe[a:b], ids[a:b], w[a:b], self.w13, self.w2, self.act, ctx.state.ep, plan)
        y = ctx.pad_tokens_to_shard(y)
        if not ctx.sequence_parallel:
            y = ctx.gather_tokens(y)
        if self.latent:
            if self.routed_expert_norm is not None:
                y = self.routed_expert_norm(y)
            y = self.routed_expert_up_proj(y)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x, plan)
        return y
