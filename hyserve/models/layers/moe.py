"""Dense FFN, MoE (Kimi Linear) and LatentMoE (K3) blocks (docs/ARCHITECTURE.md §4.5)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hyserve.models.config import ModelConfig
from hyserve.models.layers.activation import GLU
from hyserve.models.layers.merged import merged
from hyserve.models.layers.norm import RMSNorm
from hyserve.ops import moe as moe_ops
from hyserve.ops.dense_gemv import gemv
from hyserve.ops.dispatch import records_grad
from hyserve.ops.kernel_plan import REFERENCE, KernelPlan, active
from hyserve.ops.moe_gemv import PairParts, experts_forward_gemv, shared_fits
from hyserve.ops.moe_grouped import experts_forward_grouped
from hyserve.ops.moe_triton import experts_forward_triton


def _linear(i: int, o: int) -> nn.Linear:
    return nn.Linear(i, o, bias=False)


def glu_of(cfg: ModelConfig) -> GLU:
    return GLU(cfg.hidden_act, cfg.situ_beta, cfg.situ_linear_beta)


class DenseMLP(nn.Module):
    def __init__(self, dim: int, inter: int, act: GLU):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = _linear(dim, inter), _linear(dim, inter), _linear(inter, dim)
        self.act = act

    def forward(self, x: torch.Tensor, plan: KernelPlan | None = None) -> torch.Tensor:
        plan = active(plan)
        weights = (self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight)
        if plan.dense_mlp_one_token(x, self.act.kind, *weights):
            return self._one_token(x, plan)
        return self.down_proj(self.act(self.gate_proj(x), self.up_proj(x)))

    def _one_token(self, x: torch.Tensor, plan: KernelPlan) -> torch.Tensor:
        """A decode token on the GPU: gate | up as one GEMM, then the down GEMV reads SiLU(gate)·up as it
        goes. At the 48B layer-0 shape this replaced two GEMMs at half speed each, five activation
        kernels and a split-K reduce: 51.6 µs of a batch-1 step (profiled on an H200, 2026-11-30)."""
        w13 = merged(self, "_merged_gate_up", [self.gate_proj.weight, self.up_proj.weight])
        down = self.down_proj.weight
        return gemv(F.linear(x, w13), down, plan.gemv_config(*down.shape, silu_glu=True), silu_glu=True)


class Router(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(cfg.num_experts, cfg.hidden_size, dtype=torch.float32))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(cfg.num_experts, dtype=torch.float32))
        self.top_k, self.renormalize, self.scaling = cfg.num_experts_per_tok, cfg.moe_renormalize, cfg.routed_scaling_factor
        self.n_group, self.topk_group = cfg.num_expert_group, cfg.topk_group

    def forward(self, x: torch.Tensor, plan: KernelPlan | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        # on the GPU the selection is one kernel (ops/router_topk.py; no backward): the reference's stable
        # segmented sort of [T, E] scores took 4.8 ms of an 8K prefill (26 layers, profiled)
        kernel = active(plan).router_kernel(x.shape[0], grad=records_grad(x, self.weight))
        if kernel != REFERENCE:
            from hyserve.ops.router_topk import route_topk_fast, router_fused

            if kernel == "fused":
                return router_fused(x, self.weight, self.e_score_correction_bias, self.top_k, self.renormalize,
                                    self.scaling)
            logits = x.float() @ self.weight.float().t()
            return route_topk_fast(logits, self.e_score_correction_bias, self.top_k, self.renormalize, self.scaling)
        return moe_ops.route(
            x, self.weight, self.e_score_correction_bias, self.top_k, renormalize=self.renormalize,
            scaling=self.scaling, n_group=self.n_group, topk_group=self.topk_group,
        )


class MoE(nn.Module):
    """Routed experts (stacked weights) + shared experts; K3 adds the latent projections around the experts."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d, e, inter = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
        self.act = glu_of(cfg)
        self.gate = Router(cfg)
        self.latent = cfg.latent_moe_dim is not None
        expert_dim = cfg.latent_moe_dim if self.latent else d
        if self.latent:
            self.routed_expert_down_proj = _linear(d, expert_dim)
            self.routed_expert_norm = RMSNorm(expert_dim, cfg.rms_norm_eps) if cfg.latent_moe_norm else None
            self.routed_expert_up_proj = _linear(expert_dim, d)
        self.w13 = nn.Parameter(torch.zeros(e, 2 * inter, expert_dim))
        self.w2 = nn.Parameter(torch.zeros(e, expert_dim, inter))
        self.shared_experts = (
            DenseMLP(d, inter * cfg.num_shared_experts, self.act) if cfg.num_shared_experts else None
        )

    def forward(self, x: torch.Tensor, summed: bool = True, plan: KernelPlan | None = None) -> torch.Tensor | PairParts:
        """Routed experts by the kernel the plan picks for the step's token-expert pairs; the training plan
        runs every expert on every token (`dense_experts`: static shapes, differentiable). summed=False lets
        the decode kernels return their unsummed `PairParts` where nothing follows them in the layer (for
        `add_rms_norm` to sum)."""
        plan = active(plan)
        ids, w = self.gate(x, plan)
        xe = self.routed_expert_down_proj(x) if self.latent else x
        shared = self.shared_experts
        kernel = "dense" if plan.training else plan.moe_experts(ids.numel(), xe.dtype, records_grad(xe, self.w13, self.w2))
        if kernel == "gemv":  # decode: read only the selected experts' rows
            # the shared expert rides in the same two launches when it has the routed experts' shape
            fused = shared if plan.moe_gemv_shared and shared_fits(shared, self.w13, self.w2) else None
            shared = None if fused is not None else shared
            last = shared is None and not self.latent
            y = experts_forward_gemv(xe, ids, w, self.w13, self.w2, self.act, shared=fused, summed=summed or not last)
            if isinstance(y, PairParts):
                return y
        else:
            # the Triton grouped GEMM is faster than torch._grouped_mm on an H200 at every size measured: 1.5x
            # at 64-256 tokens, where it streams the touched experts at about copy speed, and 1.6x at 8K
            # (docs/BENCHMARKS.md); _grouped_mm serves autograd
            y = {"dense": dense_experts, "triton": experts_forward_triton, "grouped_mm": experts_forward_grouped,
                 REFERENCE: moe_ops.experts_forward}[kernel](xe, ids, w, self.w13, self.w2, self.act)
        if self.latent:
            if self.routed_expert_norm is not None:
                y = self.routed_expert_norm(y)
            y = self.routed_expert_up_proj(y)
        if shared is not None:
            y = y + shared(x, plan)
        return y


def dense_experts(
    x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, act,
) -> torch.Tensor:
    """`moe.experts_forward` computed for every expert on every token, combined with the routing weights
    scattered into a dense [T, E] matrix (zero for experts not picked): the training plan's experts, no
    `.tolist()` of expert counts; at the trained model's size the extra expert FLOPs are cheap."""
    inter = w13.shape[1] // 2
    h = torch.matmul(x.unsqueeze(0), w13.transpose(1, 2))  # [E, T, 2I]
    out = torch.bmm(act(h[..., :inter], h[..., inter:]), w2.transpose(1, 2))  # [E, T, D]
    gate = torch.zeros(x.shape[0], w13.shape[0], dtype=torch.float32, device=x.device)
    gate = gate.scatter(1, ids, weights.float())
    return torch.einsum("te,etd->td", gate.to(out.dtype), out).to(x.dtype)
