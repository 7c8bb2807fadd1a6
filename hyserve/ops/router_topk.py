"""The sigmoid router as Triton kernels (DESIGN.md §6; reference: ops/moe.route).

After the fp32 router GEMM, the reference takes about ten kernels per MoE layer (sigmoid, bias, a stable
sort, gather, sum, divide, scale); at batch 1 those launches cost more than the GEMM. The selection of one
token: s = sigmoid(logits), choice = s + bias, k rounds of argmax with ties to the lower expert id (the
stable sort's order), the chosen s renormalised and scaled. Only the group-free router (n_group 1, as
every preset has) is covered; the layer keeps the reference otherwise.

`route_topk_fast` selects from given logits, one program per token. `router_fused` also computes the
logits, for the few tokens of a small decode step: programs over blocks of experts read the fp32 router
weight once (bf16 x is widened in registers: no cast kernel), and the last of them to finish selects
(ops/arrival.py). At batch 1 this is one launch where the cast, the cuBLAS GEMV and the selection were
three (about 10 µs per layer, profiled).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hyserve.ops.arrival import arrival_counters


@triton.jit
def _select_one(logit_ptr, bias_ptr, ids_ptr, w_ptr, E, scaling, K: tl.constexpr, KP: tl.constexpr,
                EP: tl.constexpr, RENORM: tl.constexpr, HAS_BIAS: tl.constexpr, FROM_L2: tl.constexpr):
    """One token's top-k ids and weights from its E logits (FROM_L2: the logits were written by other
    programs of this launch, so the loads skip L1, which is not coherent across SMs)."""
    e = tl.arange(0, EP)
    m = e < E
    if FROM_L2:
        logit = tl.load(logit_ptr + e, mask=m, other=0.0, cache_modifier=".cg")
    else:
        logit = tl.load(logit_ptr + e, mask=m, other=0.0)
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
def _route_kernel(logit_ptr, s_lt, bias_ptr, ids_ptr, s_it, w_ptr, s_wt, E, scaling,
                  K: tl.constexpr, KP: tl.constexpr, EP: tl.constexpr, RENORM: tl.constexpr, HAS_BIAS: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    _select_one(logit_ptr + t * s_lt, bias_ptr, ids_ptr + t * s_it, w_ptr + t * s_wt, E, scaling, K, KP, EP,
                RENORM, HAS_BIAS, False)


@triton.jit
def _router_kernel(x_ptr, s_xt, rw_ptr, s_re, logit_ptr, count_ptr, bias_ptr, ids_ptr, s_it, w_ptr, s_wt,
                   T, E, D, scaling, K: tl.constexpr, KP: tl.constexpr, EP: tl.constexpr, BE: tl.constexpr,
                   BD: tl.constexpr, RENORM: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Program b: logits of experts b·BE .. b·BE+BE-1 for every token, in fp32 (x widened, as the
    reference's x.float() @ W.float().T); then the last program to arrive selects for every token."""
    e = tl.program_id(0) * BE + tl.arange(0, BE)
    em = e < E
    for t in range(T):
        acc = tl.zeros([BE, BD], tl.float32)  # reduced across columns once, after the loop
        for d0 in range(0, D, BD):
            d = d0 + tl.arange(0, BD)
            dm = d < D
            xv = tl.load(x_ptr + t * s_xt + d, mask=dm, other=0.0).to(tl.float32)
            wv = tl.load(rw_ptr + e[:, None] * s_re + d[None, :], mask=em[:, None] & dm[None, :], other=0.0)
            acc += wv.to(tl.float32) * xv[None, :]
        tl.store(logit_ptr + t * EP + e, tl.sum(acc, axis=1), mask=em)
    # every thread's stores before the one acquire-release add (the usual grid-reduction order)
    tl.debug_barrier()
    arrived = tl.atomic_add(count_ptr, 1, sem="acq_rel")
    if arrived == tl.num_programs(0) - 1:
        for t in range(T):
            _select_one(logit_ptr + t * EP, bias_ptr, ids_ptr + t * s_it, w_ptr + t * s_wt, E, scaling, K, KP, EP,
                        RENORM, HAS_BIAS, True)
        tl.atomic_xchg(count_ptr, 0)  # ready for the next launch (graph replays reuse the counter)


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
        _route_kernel[(t,)](
            logits, logits.stride(0), b, ids, ids.stride(0), w, w.stride(0), e, float(scaling),
            K=top_k, KP=triton.next_power_of_2(top_k), EP=triton.next_power_of_2(e),
            RENORM=renormalize and top_k > 1, HAS_BIAS=bias is not None, num_warps=4,
        )
    return ids, w


def router_fused(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, top_k: int, renormalize: bool, scaling: float,
    block_e: int = 4, block_d: int = 256, num_warps: int = 4,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, D] (any float dtype), weight [E, D] fp32 -> (ids, weights) as `moe.route(x, weight, ...)`, in one
    launch. For small T (the selection of all tokens runs in one program)."""
    t, d = x.shape
    e = weight.shape[0]
    if not 1 <= top_k <= e:
        raise ValueError(f"top_k must be in [1, {e}], got {top_k}")
    x, weight = (y if y.stride(-1) == 1 else y.contiguous() for y in (x, weight))
    ids, w = _outputs(t, top_k, x.device)
    if t:
        ep = triton.next_power_of_2(e)
        logits = torch.empty(t, ep, dtype=torch.float32, device=x.device)
        b = bias.float().contiguous() if bias is not None else logits
        _router_kernel[(triton.cdiv(e, block_e),)](
            x, x.stride(0), weight, weight.stride(0), logits, arrival_counters(x.device, 1), b, ids, ids.stride(0),
            w, w.stride(0), t, e, d, float(scaling), K=top_k, KP=triton.next_power_of_2(top_k), EP=ep,
            BE=block_e, BD=block_d, RENORM=renormalize and top_k > 1, HAS_BIAS=bias is not None,
            num_warps=num_warps,
        )
    return ids, w
