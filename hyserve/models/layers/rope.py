"""Rotary position embedding with YaRN frequencies, half-split (NeoX) pairs (docs/ARCHITECTURE.md §4.3).

DeepSeek's MLA rotates interleaved pairs (x[2i], x[2i+1]); the loader permutes those weight rows to
[even | odd] so that the half-split rotation used here gives the same dot products, and one rotation
serves both MLA and the indexer. Models without RoPE (Kimi) never build this.
"""

from __future__ import annotations

import math

import torch


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_inv_freq(dim: int, theta: float, scaling: dict | None, max_positions: int) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [dim/2] fp32, attention factor applied to cos and sin)."""
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    if not scaling or scaling.get("rope_type", scaling.get("type", "default")) == "default":
        return 1.0 / pos_freqs, 1.0
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind != "yarn":
        raise ValueError(f"unsupported rope scaling '{kind}' (hyserve implements YaRN)")
    orig = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or max_positions / orig
    mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    attn_factor = scaling.get("attention_factor")
    if attn_factor is None:  # cos/sin scaling; 1.0 for DeepSeek V3.2 (mscale == mscale_all_dim)
        attn_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all) if mscale and mscale_all \
            else yarn_mscale(factor)
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def corr(n_rot: float) -> float:  # the pair index whose wavelength makes n_rot turns over `orig`
        return dim * math.log(orig / (n_rot * 2 * math.pi)) / (2 * math.log(theta))

    low, high = corr(beta_fast), corr(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a one-point ramp would divide by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrap = 1 - ramp  # weight of the unscaled frequency
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrap) + (1.0 / pos_freqs) * extrap
    return inv, float(attn_factor)


class Rotary(torch.nn.Module):
    """cos/sin for absolute positions; `apply` rotates half-split pairs (x[i], x[i + d/2])."""

    def __init__(self, dim: int, theta: float, scaling: dict | None, max_positions: int):
        super().__init__()
        self.args = (dim, theta, scaling, max_positions)
        self.attn_factor = rope_inv_freq(*self.args)[1]
        # computed on first use, not at construction: models are built on the meta device
        self._inv_freq: torch.Tensor | None = None

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        if self._inv_freq is None or self._inv_freq.device != device:
            with torch.device("cpu"):
                self._inv_freq = rope_inv_freq(*self.args)[0].to(device)
        return self._inv_freq

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq(positions.device)[None, :]
        return freqs.cos() * self.attn_factor, freqs.sin() * self.attn_factor

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, ..., d]; cos/sin [T, d/2]. Computed in x's dtype after rounding cos/sin to it, as
        transformers does, so float32 parity is exact up to summation order."""
        half = x.shape[-1] // 2
        shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (half,)
        c, s = cos.to(x.dtype).view(shape), sin.to(x.dtype).view(shape)
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1)
