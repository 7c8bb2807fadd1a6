"""The sigmoid router as Triton kernels (DESIGN.md §6; reference: ops/moe.route).

After the fp32 router GEMM, the reference takes about ten kernels per MoE layer (sigmoid, bias, a stable
sort, gather, sum, divide, scale); at batch 1 those launches cost more than the GEMM. The selection of one
token: s = sigmoid(logits), key = s + bias, the k highest keys with ties to the lower expert id (the
stable sort's order), their s renormalised and scaled. Only the group-free router (n_group 1, as every
preset has) is covered; the layer keeps the reference otherwise.

`route_topk_fast` selects from given logits, one program per token. `router_fused` also computes the
logits, for the few tokens of a small decode step: each program of the first launch reads one [experts,
columns] tile of the fp32 router weight (bf16 x is widened in registers: no cast kernel) and stores
partial logits; the selection kernel sums each token's partials in order. Two launches where the cast,
the cuBLAS GEMV and the selection were three. One launch whose last program to finish (ops/arrival.py)
selected took 12.1 µs per layer in a batch-1 step's graph (H200, 2026-11-30), more than a second
launch: every program's store, fence and atomic lengthen the critical path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _select_one(logit_ptr, bias_ptr, ids_ptr, w_ptr, E, scaling, K: tl.constexpr, KP: tl.constexpr,
                EP: tl.constexpr, RENORM: tl.constexpr, HAS_BIAS: tl.constexpr, CACHE: tl.constexpr):
    """One token's top-k ids and weights from its E logits: k rounds of argmax, ties to the lowest id (the
    stable sort's order). CACHE ".cg": the logits were written in this launch, so the loads skip L1
    (not coherent across SMs). (Ranking every expert against all E keys instead, a handful of wide
    reductions, took 8.7 µs per call in a batch-1 step against about 4 µs for these 3k narrow ones; H200,
    2026-11-30.)"""
    e = tl.arange(0, EP)
    m = e < E
    logit = tl.load(logit_ptr + e, mask=m, other=0.0, cache_modifier=CACHE)
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
    tl.store(ids_ptr + j, ids, mask=j < K)
    tl.store(w_ptr + j, ws * scaling, mask=j < K)


@triton.jit
def _route_kernel(logit_ptr, s_lt, bias_ptr, ids_ptr, s_it, w_ptr, s_wt, T, E, scaling,
                  K: tl.constexpr, KP: tl.constexpr, EP: tl.constexpr, ND: tl.constexpr,
                  RENORM: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Program t selects for token t. ND > 1: its logits are ND partial rows (row j·T + t, stride s_lt),
    summed in order into row ND·T + t first."""
    t = tl.program_id(0).to(tl.int64)
    row = logit_ptr + t * s_lt
    if ND > 1:
        e = tl.arange(0, EP)
        logit = tl.zeros([EP], tl.float32)
        for j in tl.static_range(ND):
            logit += tl.load(logit_ptr + (j * T + t) * s_lt + e)
        row = logit_ptr + (ND * T + t) * s_lt
        tl.store(row + e, logit)
        tl.debug_barrier()  # the row is read back across threads
    _select_one(row, bias_ptr, ids_ptr + t * s_it, w_ptr + t * s_wt, E, scaling, K, KP, EP, RENORM, HAS_BIAS,
                ".cg" if ND > 1 else "")


@triton.jit
def _router_logits_kernel(x_ptr, s_xt, rw_ptr, s_re, part_ptr, T, E, D, EP: tl.constexpr, BE: tl.constexpr,
                          BD: tl.constexpr):
    """Program (b, c): the fp32 partial logits of experts b·BE .. b·BE+BE-1 over columns c·BD .. c·BD+BD-1,
    every token (x widened, as the reference's x.float() @ W.float().T), into row c·T + t; one load of
    the weight tile per program, no loop."""
    e = tl.program_id(0) * BE + tl.arange(0, BE)
    c = tl.program_id(1)
    d = c * BD + tl.arange(0, BD)
    em, dm = e < E, d < D
    wv = tl.load(rw_ptr + e[:, None] * s_re + d[None, :], mask=em[:, None] & dm[None, :], other=0.0).to(tl.float32)
    for t in range(T):
        xv = tl.load(x_ptr + t * s_xt + d, mask=dm, other=0.0).to(tl.float32)
        tl.store(part_ptr + (c * T + t) * EP + e, tl.sum(wv * xv[None, :], axis=1), mask=em)


def _outputs(t: int, top_k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.empty(t, top_k, dtype=torch.long, device=device)
    return ids, torch.empty(t, top_k, dtype=torch.float32, device=device)


def route_topk_fast(
    logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, renormalize: bool, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] fp32 (x @ Wᵀ) -> (ids [T, k] long, weights [T, k] fp32), as `moe.route` selects."""
    t, e = logits.shape
    if not 1 <= top_k <= e:
        raise ValueError(f"top_k must be in [1, {e}], got {top_k}")
    logits = logits.float().contiguous()
    ids, w = _outputs(t, top_k, logits.device)
    if t:
        b = bias.float().contiguous() if bias is not None else logits
        ep = triton.next_power_of_2(e)
        _route_kernel[(t,)](
            logits, logits.stride(0), b, ids, ids.stride(0), w, w.stride(0), t, e, float(scaling),
            K=top_k, KP=triton.next_power_of_2(top_k), EP=ep, ND=1, RENORM=renormalize and top_k > 1,
            HAS_BIAS=bias is not None, num_warps=4,
        )
    return ids, w


def router_fused(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, top_k: int, renormalize: bool, scaling: float,
    block_e: int = 8, block_d: int = 256, num_warps: int = 4,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, D] (any float dtype), weight [E, D] fp32 -> (ids, weights) as `moe.route(x, weight, ...)`, in two
    launches: partial logits over a grid of weight tiles, then the selection of each token."""
    t, d = x.shape
    e = weight.shape[0]
    if not 1 <= top_k <= e:
        raise ValueError(f"top_k must be in [1, {e}], got {top_k}")
    x, weight = (y if y.stride(-1) == 1 else y.contiguous() for y in (x, weight))
    ids, w = _outputs(t, top_k, x.device)
    if t:
        ep, nd = triton.next_power_of_2(e), triton.cdiv(d, block_d)
        part = torch.empty((nd + 1) * t, ep, dtype=torch.float32, device=x.device)  # partials, then logits
        _router_logits_kernel[(triton.cdiv(e, block_e), nd)](
            x, x.stride(0), weight, weight.stride(0), part, t, e, d, EP=ep, BE=block_e, BD=block_d,
            num_warps=num_warps,
        )
        b = bias.float().contiguous() if bias is not None else part
        _route_kernel[(t,)](
            part, ep, b, ids, ids.stride(0), w, w.stride(0), t, e, float(scaling), K=top_k,
            KP=triton.next_power_of_2(top_k), EP=ep, ND=nd, RENORM=renormalize and top_k > 1,
            HAS_BIAS=bias is not None, num_warps=4,
        )
    return ids, w
