"""The sigmoid router as Triton kernels (docs/ARCHITECTURE.md §7; reference: ops/moe.route).

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

from hyserve.ops.dispatch import use_pdl

# programmatic dependent launch for the small-batch router (off: plain launches, to compare against)
PDL = True


@triton.jit
def _select_one(logit, e, m, bias_ptr, ids_ptr, w_ptr, scaling, K: tl.constexpr, KP: tl.constexpr,
                EP: tl.constexpr, RENORM: tl.constexpr, HAS_BIAS: tl.constexpr):
    """One token's top-k ids and weights from its logits [EP] (lanes e, valid where m). Each key packs a
    choice's order-preserving integer image over (EP-1-e), so one integer max per round finds the highest
    choice and, among equal ones, the lowest id (the stable sort's order). (Three float reductions per
    round on 4 warps took about 4 µs per call in a batch-1 step; ranking every expert against all E keys
    in a few wide reductions took 8.7 µs; H200, 2026-11-30.)"""
    s = 1.0 / (1.0 + tl.exp(-logit))
    choice = s + tl.load(bias_ptr + e, mask=m, other=0.0) if HAS_BIAS else s
    choice = tl.where(choice == 0.0, 0.0, choice)  # -0.0 as +0.0: equal floats, equal keys
    bits = choice.to(tl.int32, bitcast=True)
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # as signed ints, in the floats' order
    key = (ordered.to(tl.int64) << 32) | (EP - 1 - e).to(tl.int64)
    key = tl.where(m, key, tl.full([EP], -9223372036854775808, tl.int64))
    j = tl.arange(0, KP)
    ids = tl.zeros([KP], tl.int64)
    for r in tl.static_range(K):
        best = EP - 1 - tl.max(key, axis=0).to(tl.int32)  # the low word: EP-1-id
        ids = tl.where(j == r, best.to(tl.int64), ids)
        key = tl.where(e == best, -9223372036854775808, key)
    ws = tl.sum(tl.where(ids[:, None] == e[None, :], s[None, :], 0.0), axis=1)
    ws = tl.where(j < K, ws, 0.0)
    if RENORM:
        ws = ws / (tl.sum(ws, axis=0) + 1e-20)
    tl.store(ids_ptr + j, ids, mask=j < K)
    tl.store(w_ptr + j, ws * scaling, mask=j < K)


@triton.jit
def _route_kernel(logit_ptr, s_lt, bias_ptr, ids_ptr, s_it, w_ptr, s_wt, T, E, scaling,
                  K: tl.constexpr, KP: tl.constexpr, EP: tl.constexpr, ND: tl.constexpr,
                  RENORM: tl.constexpr, HAS_BIAS: tl.constexpr, PDL: tl.constexpr):
    """Program t selects for token t, whose logits are the sum of ND partial rows (row j·T + t, stride
    s_lt) in order j = 0, 1, ... PDL: launched while the logits kernel runs; the wait comes before the
    first read of its rows."""
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, EP)
    m = e < E
    if PDL:
        tl.extra.cuda.gdc_wait()
    logit = tl.zeros([EP], tl.float32)
    for j in tl.static_range(ND):
        logit += tl.load(logit_ptr + (j * T + t) * s_lt + e, mask=m, other=0.0)
    _select_one(logit, e, m, bias_ptr, ids_ptr + t * s_it, w_ptr + t * s_wt, scaling, K, KP, EP, RENORM, HAS_BIAS)


@triton.jit
def _router_logits_kernel(x_ptr, s_xt, rw_ptr, s_re, part_ptr, T, E, D, EP: tl.constexpr, BE: tl.constexpr,
                          BD: tl.constexpr, PDL: tl.constexpr):
    """Program (b, c): the fp32 partial logits of experts b·BE .. b·BE+BE-1 over columns c·BD .. c·BD+BD-1,
    every token (x widened, as the reference's x.float() @ W.float().T), into row c·T + t; one load of
    the weight tile per program, no loop. PDL: launched while the kernel before it (the norm that makes
    x) runs, the weight tile is loaded before the wait, and the selection kernel may launch at once."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    e = tl.program_id(0) * BE + tl.arange(0, BE)
    c = tl.program_id(1)
    d = c * BD + tl.arange(0, BD)
    em, dm = e < E, d < D
    wv = tl.load(rw_ptr + e[:, None] * s_re + d[None, :], mask=em[:, None] & dm[None, :], other=0.0).to(tl.float32)
    if PDL:
        tl.extra.cuda.gdc_wait()
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
            HAS_BIAS=bias is not None, PDL=False, num_warps=1,
        )
    return ids, w


def router_fused(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, top_k: int, renormalize: bool, scaling: float,
    block_e: int = 8, block_d: int = 256, num_warps: int = 4, pdl: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, D] (any float dtype), weight [E, D] fp32 -> (ids, weights) as `moe.route(x, weight, ...)`, in two
    launches: partial logits over a grid of weight tiles, then the selection of each token. pdl (default:
    `PDL` on a GPU of compute capability 9+): both launch as programmatic dependents of the kernel before
    them, so the weight loads and the launches overlap it. The logits kernel then reads the weight before
    its wait: no kernel still running may write the weight (a parameter, as the Router's); a weight that
    needs a contiguous copy first is launched plainly."""
    t, d = x.shape
    e = weight.shape[0]
    if not 1 <= top_k <= e:
        raise ValueError(f"top_k must be in [1, {e}], got {top_k}")
    pdl = use_pdl(x, pdl, PDL)
    pdl = pdl and weight.stride(-1) == 1  # a copy made just before would still be in flight at the early read
    x, weight = (y if y.stride(-1) == 1 else y.contiguous() for y in (x, weight))
    ids, w = _outputs(t, top_k, x.device)
    if t:
        ep, nd = triton.next_power_of_2(e), triton.cdiv(d, block_d)
        part = torch.empty(nd * t, ep, dtype=torch.float32, device=x.device)
        extra = {"launch_pdl": True} if pdl else {}
        b = bias.float().contiguous() if bias is not None else part  # before the launches: it may copy
        _router_logits_kernel[(triton.cdiv(e, block_e), nd)](
            x, x.stride(0), weight, weight.stride(0), part, t, e, d, EP=ep, BE=block_e, BD=block_d, PDL=pdl,
            num_warps=num_warps, **extra,
        )
        _route_kernel[(t,)](
            part, ep, b, ids, ids.stride(0), w, w.stride(0), t, e, float(scaling), K=top_k,
            KP=triton.next_power_of_2(top_k), EP=ep, ND=nd, RENORM=renormalize and top_k > 1,
            HAS_BIAS=bias is not None, PDL=pdl, num_warps=1, **extra,
        )
    return ids, w
