"""Dense FFN, MoE (Kimi Linear) and LatentMoE (K3) blocks (spec/models.md §2.6, §3.6)."""

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
from hyserve.ops.dispatch import fast_path, no_grad_fast_path
from hyserve.ops.moe_gemv import PairParts, experts_forward_gemv, shared_fits
from hyserve.ops.moe_grouped import experts_forward_grouped, grouped_mm_available
from hyserve.ops.moe_triton import experts_forward_triton

# up to this many tokens the router runs as a tile-parallel GEMV into partial logits and a selection kernel
# (no cast, no cuBLAS): 11.4 against 13.3 µs for cast + cuBLAS GEMV + selection at 1 token, 12.8 against
# 19.9 µs at 4 tokens (H200, 26 layers' weights in one graph, 2026-11-30)
FUSED_ROUTER_MAX_TOKENS = 4


def _linear(i: int, o: int) -> nn.Linear:
    return nn.Linear(i, o, bias=False)


def glu_of(cfg: ModelConfig) -> GLU:
    return GLU(cfg.hidden_act, cfg.situ_beta, cfg.situ_linear_beta)


class DenseMLP(nn.Module):
    def __init__(self, dim: int, inter: int, act: GLU):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = _linear(dim, inter), _linear(dim, inter), _linear(inter, dim)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights = (self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight)
        if x.dim() == 2 and x.shape[0] == 1 and self.act.kind == "silu" and no_grad_fast_path(x, *weights):
            return self._one_token(x)
        return self.down_proj(self.act(self.gate_proj(x), self.up_proj(x)))

    def _one_token(self, x: torch.Tensor) -> torch.Tensor:
        """A decode token on the GPU: gate | up as one GEMM, then the down GEMV reads SiLU(gate)·up as it
        goes. At the 48B layer-0 shape this replaced two GEMMs at half speed each, five activation
        kernels and a split-K reduce: 51.6 µs of a batch-1 step (profiled on an H200, 2026-11-30)."""
        w13 = merged(self, "_merged_gate_up", [self.gate_proj.weight, self.up_proj.weight])
        return gemv(F.linear(x, w13), self.down_proj.weight, silu_glu=True)


class Router(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(cfg.num_experts, cfg.hidden_size, dtype=torch.float32))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(cfg.num_experts, dtype=torch.float32))
        self.top_k, self.renormalize, self.scaling = cfg.num_experts_per_tok, cfg.moe_renormalize, cfg.routed_scaling_factor
        self.n_group, self.topk_group = cfg.num_expert_group, cfg.topk_group

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # on the GPU the selection is one kernel (ops/router_topk.py; no backward): the reference's stable
        # segmented sort of [T, E] scores took 4.8 ms of an 8K prefill (26 layers, profiled)
        if no_grad_fast_path(x, self.weight) and (self.n_group == 1 or self.topk_group >= self.n_group):
            from hyserve.ops.router_topk import route_topk_fast, router_fused

            if x.shape[0] <= FUSED_ROUTER_MAX_TOKENS:
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

    def forward(self, x: torch.Tensor, experts_fn=None, summed: bool = True) -> torch.Tensor | PairParts:
        """`experts_fn(x, ids, weights, w13, w2, act)` overrides the routed-expert kernel (training uses a
        dense, differentiable one); by default the fastest available kernel is picked. summed=False lets
        the decode kernels return their unsummed `PairParts` where nothing follows them in the layer (for
        `add_rms_norm` to sum)."""
        ids, w = self.gate(x)
        xe = self.routed_expert_down_proj(x) if self.latent else x
        shared = self.shared_experts
        if experts_fn is not None:
            y = experts_fn(xe, ids, w, self.w13, self.w2, self.act)
        elif fast_path(xe) and ids.numel() <= 64:  # decode: read only the selected experts' rows
            # the shared expert rides in the same two launches when it has the routed experts' shape
            fused = shared if shared is not None and not self.latent and shared_fits(shared, self.w13, self.w2) else None
            shared = None if fused is not None else shared
            last = shared is None and not self.latent
            y = experts_forward_gemv(xe, ids, w, self.w13, self.w2, self.act, shared=fused, summed=summed or not last)
            if isinstance(y, PairParts):
                return y
        elif no_grad_fast_path(xe, self.w13, self.w2) and xe.dtype != torch.float32:
            # faster than torch._grouped_mm on an H200 at every size measured: 1.5x at 64-256 tokens, where
            # it streams the touched experts at about copy speed, and 1.6x at 8K (docs/BENCHMARKS.md); also
            # fp16, or a GPU before sm90 (fp32 keeps the exact loop; training keeps autograd)
            y = experts_forward_triton(xe, ids, w, self.w13, self.w2, self.act)
        elif fast_path(xe) and grouped_mm_available(xe, self.w13):
            y = experts_forward_grouped(xe, ids, w, self.w13, self.w2, self.act)
        else:
            y = moe_ops.experts_forward(xe, ids, w, self.w13, self.w2, self.act)
        if self.latent:
            if self.routed_expert_norm is not None:
                y = self.routed_expert_norm(y)
            y = self.routed_expert_up_proj(y)
        if shared is not None:
            y = y + shared(x)
        return y
