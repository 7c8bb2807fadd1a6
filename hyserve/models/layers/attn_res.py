"""Block Attention Residuals (docs/ARCHITECTURE.md §4.6): a softmax mix over banked blocks and the prefix."""

from __future__ import annotations

import torch
from torch import nn


class AttnRes(nn.Module):
    """Holds `proj` [1, D] and `norm` [D]; their product is the folded query u."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.proj = nn.Parameter(torch.zeros(1, dim))
        self.norm = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, blocks: list[torch.Tensor], prefix: torch.Tensor) -> torch.Tensor:
        return attn_res(blocks + [prefix], self.norm.float() * self.proj.float()[0], self.eps)


def attn_res(sources: list[torch.Tensor], u: torch.Tensor, eps: float) -> torch.Tensor:
    """score_s = <V_s, u> / rms(V_s); out = sum_s softmax(score)_s V_s; fp32 inside, source dtype out."""
    v = torch.stack([s.float() for s in sources], 0)  # [S, T, D]
    score = (v @ u) * torch.rsqrt(v.pow(2).mean(-1) + eps)  # [S, T]
    p = torch.softmax(score, 0)
    return (p.unsqueeze(-1) * v).sum(0).to(sources[-1].dtype)
