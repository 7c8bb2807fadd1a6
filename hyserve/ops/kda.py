"""KDA reference math (docs/ARCHITECTURE.md §4.2), fp32, in hyserve's V-first state layout.

These functions are the specification the GPU kernels are tested against. State M is [.., H, V, K].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    """fp32, except that float64 inputs stay float64 so the exactness tests can run in double."""
    return x if x.dtype == torch.float64 else x.float()


def kda_gate(
    f: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float | None
) -> torch.Tensor:
    """Log decay g [.., H, K] from the gate projection f [.., H, K] (fp32).

    Kimi Linear: g = -exp(A_log) * softplus(f + dt_bias). K3 (bounded): g = b * sigmoid(exp(A_log) * (f + dt_bias)).
    """
    h, k = f.shape[-2], f.shape[-1]
    x = f.float() + dt_bias.float().view(h, k)
    a = a_log.float().view(h, 1)
    if lower_bound is None:
        return -torch.exp(a) * F.softplus(x, beta=1.0, threshold=20.0)
    return lower_bound * torch.sigmoid(torch.exp(a) * x)


def short_conv(x: torch.Tensor, weight: torch.Tensor, tail: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise conv + SiLU over one sequence.

    x [T, C] new inputs, weight [C, W], tail [C, W-1] earlier inputs oldest first (None = zeros).
    Returns (SiLU(conv) [T, C] in fp32, new tail [C, W-1] in x's dtype).
    """
    t, c = x.shape
    w = weight.shape[-1]
    if tail is None:
        tail = x.new_zeros(c, w - 1)
    xx = torch.cat([tail.to(x.dtype).t(), x], 0)  # [T+W-1, C]
    windows = xx.unfold(0, w, 1)  # [T, C, W]
    y = (windows.float() * weight.float()).sum(-1)
    return F.silu(y), xx[-(w - 1) :].t().contiguous()


def short_conv_step(x: torch.Tensor, weight: torch.Tensor, tail: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per sequence: x [N, C], tail [N, C, W-1]. Returns (SiLU(conv) [N, C] fp32, new tail)."""
    window = torch.cat([tail.to(x.dtype), x.unsqueeze(-1)], -1)  # [N, C, W]
    y = (window.float() * weight.float()).sum(-1)
    return F.silu(y), window[..., 1:]


def kda_recurrent(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token delta rule for a batch of sequences, one token each.

    q, k [N, H, K] (already L2-normalised), v [N, H, V], g [N, H, K] log decay, beta [N, H],
    state [N, H, V, K]. Returns (o [N, H, V], new state); all fp32.
    """
    m = _at_least_fp32(state) * torch.exp(g).unsqueeze(-2)  # decay the key columns
    pred = torch.einsum("nhvk,nhk->nhv", m, k)
    m = m + torch.einsum("nhv,nhk->nhvk", beta.unsqueeze(-1) * (v - pred), k)
    o = torch.einsum("nhvk,nhk->nhv", m, q * scale)
    return o, m


def kda_recurrent_seq(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence over T tokens of one sequence (q, k, g [T, H, K]; v [T, H, V]; state [H, V, K])."""
    outs, m = [], _at_least_fp32(state).unsqueeze(0)
    for t in range(q.shape[0]):
        o, m = kda_recurrent(q[t : t + 1], k[t : t + 1], v[t : t + 1], g[t : t + 1], beta[t : t + 1], m, scale)
        outs.append(o)
    return torch.cat(outs, 0), m.squeeze(0)


def kda_chunk(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, scale: float, chunk_size: int = 32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked (WY) form over one sequence; equals `kda_recurrent_seq` in exact arithmetic.

    Shapes as kda_recurrent_seq. Works in fla's K-first S = Mᵀ internally; returns (o [T, H, V], M).
    """
    s = _at_least_fp32(state).transpose(-1, -2)  # [H, K, V]
    q, k, v, g, beta = (_at_least_fp32(x).transpose(0, 1) for x in (q, k, v, g, beta))  # head-major
    outs = []
    for c0 in range(0, q.shape[1], chunk_size):
        sl = slice(c0, c0 + chunk_size)
        qc, kc, vc, gc, bc = q[:, sl] * scale, k[:, sl], v[:, sl], g[:, sl], beta[:, sl]
        n = qc.shape[1]
        gam = gc.cumsum(1)  # [H, C, K]
        diff = gam.unsqueeze(2) - gam.unsqueeze(1)  # [H, r, s, K] = Γ_r - Γ_s
        causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        decay = torch.exp(diff.masked_fill(~causal[None, :, :, None], float("-inf")))
        kk = torch.einsum("hrk,hsk,hrsk->hrs", kc, kc, decay)
        lower = (bc.unsqueeze(-1) * kk).tril(-1)
        eye = torch.eye(n, dtype=lower.dtype, device=q.device).expand_as(lower)
        ab = torch.cat([bc.unsqueeze(-1) * vc, bc.unsqueeze(-1) * kc * torch.exp(gam)], -1)
        sol = torch.linalg.solve_triangular(eye + lower, ab, upper=False, unitriangular=True)
        u, wm = sol[..., : vc.shape[-1]], sol[..., vc.shape[-1] :]
        v_new = u - wm @ s
        attn = torch.einsum("hrk,hsk,hrsk->hrs", qc, kc, decay)
        outs.append((qc * torch.exp(gam)) @ s + attn @ v_new)
        g_last = gam[:, -1:, :]  # [H, 1, K]
        s = torch.exp(g_last).transpose(1, 2) * s + (kc * torch.exp(g_last - gam)).transpose(1, 2) @ v_new
    return torch.cat(outs, 1).transpose(0, 1), s.transpose(-1, -2)
