"""The sigmoid router's selection in one Triton kernel (DESIGN.md §6; reference: ops/moe.route).

After the fp32 router GEMM, the reference takes about ten kernels per MoE layer (sigmoid, bias, a stable
sort, gather, sum, divide, scale); at batch 1 those launches cost more than the GEMM. One program per
token does the same: s = sigmoid(logits), choice = s + bias, k rounds of argmax with ties to the lower
expert id (the stable sort's order), the chosen s renormalised and scaled. Only the group-free router
(n_group 1, as every preset has) is covered; the layer keeps the reference otherwise.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _route_kernel(logit_ptr, s_lt, bias_ptr, ids_ptr, s_it, w_ptr, s_wt, E, scaling,
                  K: tl.constexpr, KP: tl.constexpr, EP: tl.constexpr, RENORM: tl.constexpr, HAS_BIAS: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, EP)
    m = e < E
    logit = tl.load(logit_ptr + t * s_lt + e, mask=m, other=0.0)
    s = 1.0 / (1.0 + tl.exp(-logit))
    choice = s + tl.load(bias_ptr + e, mask=m, other=0.0) if HAS_BIAS else s
    avail = m
    j = tl.arange(0, KP)
    ids = tl.zeros([KP], tl.int64)
    ws = tl.zeros([KP], tl.float32)
    for r in tl.static_range(K):
        top = tl.max(tl.where(avail, choice, float("-inf")), axis=0)
        best = tl.min(tl.where(avail & (choice == top), e, EP), axis=0)  # ties: the lowest id, explicitly
        ids = tl.where(j == r, best.to(tl.int64), ids)
        ws = tl.where(j == r, tl.sum(tl.where(e == best, s, 0.0), axis=0), ws)
        avail = avail & (e != best)
    if RENORM:
        ws = ws / (tl.sum(ws, axis=0) + 1e-20)
    tl.store(ids_ptr + t * s_it + j, ids, mask=j < K)
    tl.store(w_ptr + t * s_wt + j, ws * scaling, mask=j < K)


def route_topk_fast(
    logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, renormalize: bool, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] fp32 (x @ Wᵀ) -> (ids [T, k] long, weights [T, k] fp32), as `moe.route` selects."""
    t, e = logits.shape
    if not 1 <= top_k <= e:
        raise ValueError(f"top_k must be in [1, {e}], got {top_k}")
    logits = logits.float().contiguous()
    ids = torch.empty(t, top_k, dtype=torch.long, device=logits.device)
    w = torch.empty(t, top_k, dtype=torch.float32, device=logits.device)
    if t:
        b = bias.float().contiguous() if bias is not None else logits
        _route_kernel[(t,)](
            logits, logits.stride(0), b, ids, ids.stride(0), w, w.stride(0), e, float(scaling),
            K=top_k, KP=triton.next_power_of_2(top_k), EP=triton.next_power_of_2(e),
            RENORM=renormalize and top_k > 1, HAS_BIAS=bias is not None, num_warps=4,
        )
    return ids, w
