"""RMSNorm in the Kimi / DeepSeek form and the two fp32-to-the-end norms (docs/ARCHITECTURE.md §4.1)."""

from __future__ import annotations

import torch
from torch import nn

from hyserve.ops.dispatch import no_grad_fast_path
from hyserve.ops.moe_gemv import PairParts


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalise in fp32, cast back to the input dtype, then scale by the weight in that dtype.

    On the GPU fast path (not while autograd records: the kernel has no backward) one Triton kernel
    computes the same (ops/rms_norm.py)."""
    if no_grad_fast_path(x, weight):
        from hyserve.ops.rms_norm import rms_norm_fast

        return rms_norm_fast(x, weight, eps)
    xf = x.float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return weight.to(x.dtype) * y


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor | PairParts, weight: torch.Tensor, eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, rms_norm(x + delta)): a residual add and the next pre-norm, one kernel on the GPU. A
    decode MoE's unsummed `PairParts` are summed in that kernel too."""
    if isinstance(delta, PairParts):
        if no_grad_fast_path(x, weight) and delta.dtype == x.dtype and x.dim() == 2:
            from hyserve.ops.rms_norm import rms_norm_fast

            return rms_norm_fast(x, weight, eps, delta.part, delta.pairs)
        delta = delta.sum()
    if no_grad_fast_path(x, weight) and delta.dtype == x.dtype and not delta.requires_grad:
        from hyserve.ops.rms_norm import rms_norm_fast

        return rms_norm_fast(x, weight, eps, residual_delta=delta)
    s = x + delta
    return s, rms_norm(s, weight, eps)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """fla's form: eps inside the root, x / sqrt(sum x^2 + eps), in fp32."""
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + eps)


def gated_rms_norm(o: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """KDA output norm: fp32 throughout, weight * o / rms(o) * sigmoid(gate); returns fp32."""
    of = o.float()
    y = of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + eps)
    return weight.float() * y * torch.sigmoid(gate.float())
