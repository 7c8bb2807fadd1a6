"""Routed experts as two grouped GEMMs: token copies sorted by expert, one `torch._grouped_mm` for w1|w3
over all experts and one for w2, then the weighted sum back per token. It has a backward, so the kernel
plan takes it where autograd records (bf16 operands with 16-byte aligned rows on an sm90+ GPU, the op's
kernels; docs/ARCHITECTURE.md §7); ops/moe_triton.py is faster without autograd.

No host synchronisation (the group offsets stay on the device), so it can run inside a CUDA graph.
Same contract as `moe.experts_forward`; the routing stays in torch (`moe.route`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def experts_forward_grouped(
    x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
    act: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """y[t] = Σ_j weights[t, j] · w2_e(act(w1_e x, w3_e x)), e = ids[t, j]; fp32 sum, x's dtype out."""
    t, k = ids.shape
    e, inter = w13.shape[0], w13.shape[1] // 2
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(e, dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    offs = torch.cumsum(counts, 0, dtype=torch.int32)  # group end offsets
    tok = order // k
    h = torch._grouped_mm(x[tok], w13.transpose(1, 2), offs=offs)  # [T*k, 2I]
    a = act(h[:, :inter], h[:, inter:])
    out = torch._grouped_mm(a, w2.transpose(1, 2), offs=offs)  # [T*k, D]
    y = torch.zeros(t, w2.shape[1], dtype=torch.float32, device=x.device)
    y.index_add_(0, tok, out.float() * weights.reshape(-1)[order, None])
    return y.to(x.dtype)
