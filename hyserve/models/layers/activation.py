"""Gated activations: SiLU-GLU (Kimi Linear, DeepSeek) and SiTU-GLU (K3; docs/ARCHITECTURE.md §4.5)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class GLU:
    kind: str = "silu"  # "silu" | "situ"
    beta: float = 1.0
    linear_beta: float | None = None

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.kind == "silu":
            return (F.silu(gate.float()) * up.float()).to(gate.dtype)
        return situ_glu(gate, up, self.beta, self.linear_beta)


def situ_glu(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float | None) -> torch.Tensor:
    """[beta * tanh(g / beta) * sigmoid(g)] * [beta_l * tanh(u / beta_l)], fp32 inside.

    The sigmoid takes the uncapped g; a missing linear beta leaves u unchanged.
    """
    g, u = gate.float(), up.float()
    act = beta * torch.tanh(g / beta) * torch.sigmoid(g)
    if linear_beta is not None:
        u = linear_beta * torch.tanh(u / linear_beta)
    return (act * u).to(gate.dtype)
