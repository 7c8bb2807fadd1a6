"""MoE routing and expert compute, torch reference (docs/ARCHITECTURE.md §4.5)."""

from __future__ import annotations

from collections.abc import Callable

import torch


def topk_ordered(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Top-k indices by score descending, ties to the lower index (a stable descending sort)."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]


def route(
    x: torch.Tensor, gate_weight: torch.Tensor, bias: torch.Tensor | None, top_k: int, *,
    renormalize: bool, scaling: float, n_group: int = 1, topk_group: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid router with a selection-only correction bias. Returns (ids [T, k] long, weights [T, k] fp32)."""
    s = torch.sigmoid(x.float() @ gate_weight.float().t())
    choice = s + bias.float() if bias is not None else s
    if n_group > 1 and topk_group < n_group:
        t, e = choice.shape
        grouped = choice.view(t, n_group, e // n_group)
        group_score = grouped.topk(2, dim=-1).values.sum(-1)
        keep = torch.zeros_like(group_score, dtype=torch.bool)
        keep.scatter_(1, topk_ordered(group_score, topk_group), True)
        choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(t, e)
    ids = topk_ordered(choice, top_k)
    w = s.gather(1, ids)
    if renormalize and top_k > 1:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return ids, w * scaling


def experts_forward(
    x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
    act: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """y[t] = sum_j weights[t, j] * w2_e(act(w1_e x, w3_e x)), e = ids[t, j]; fp32 sum, x's dtype out.

    w13 [E, 2I, D] stacks w1 (gate) over w3 (up); w2 [E, D, I].
    """
    t, k = ids.shape
    inter = w13.shape[1] // 2
    if t == 0:
        return x.new_zeros(0, w2.shape[1])
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    xs = x[order // k]  # token copies grouped by expert
    outs = []
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        h = xs[start : start + n] @ w13[e].t()
        outs.append(act(h[:, :inter], h[:, inter:]) @ w2[e].t())
        start += n
    # Un-permute once and sum over k: a per-expert index_add_ costs an OpenMP region each, which
    # dominated small-batch CPU steps (about 0.5 ms per call on 2 busy cores).
    out = torch.cat(outs).float()[torch.argsort(order)].view(t, k, -1)
    return (out * weights.float().unsqueeze(-1)).sum(1).to(x.dtype)
