"""Dense projections of one decode token as a Triton GEMV (docs/ARCHITECTURE.md §7).

One program per block of output rows streams its rows once, as the MoE GEMV kernels do (ops/moe_gemv.py).
Measured on an H200 against cuBLAS at the 48B shapes (benchmarks/gpu_kernels.py --only gemv, 2026-11-30):
1.15x on the lm_head (755 MB, 4.4 TB/s: 172 µs against 197), on a par for the KDA and MLA input
projections. Where the output has few rows and a long input (the attention output 2304 x 4096) one
program per row block leaves SMs idle (0.8x cuBLAS, which splits K); split over K (the parts summed by
each row block's last split) it is 1.06x (8.9 against 9.4 µs), and the layer-0 MLP down (2304 x 9216)
with the SiLU-GLU read in replaces the activation's five small kernels too. The tiles come from a rule
of the weight's shape and the SM count (`kernel_plan.gemv_config`); which projections take the GEMV is the
kernel plan's call. Tokens after the first re-read the weight tile from cache: single-token steps only.

`gemv_tokens` takes up to 16 tokens (a verify step's rows) with the weight streamed once: each tile meets
every token in one tensor-core dot. It is not in the kernel plan yet: `benchmarks/gpu_kernels.py --only
gemv_tokens` compares it with cuBLAS at 5 and 8 tokens, which the plan runs there today.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from hyserve.ops.arrival import arrival_counters
from hyserve.ops.dispatch import use_pdl
from hyserve.ops.kernel_plan import GemvConfig, gemv_config
from hyserve.ops.moe_gemv import _gemv_rows
from hyserve.ops.ptx import prefetch_l2

# programmatic dependent launch on sm_90+ (off: plain launches, to compare against)
PDL = True
# with PDL, a weight up to this size is asked into L2 while the kernel before runs (the 48B attention
# output, 18.9 MB, fits the H200's 50 MB L2; the lm_head does not)
PREFETCH_MAX_BYTES = 32 << 20


@triton.jit
def _rounded(acc, x_ptr, y_ptr):
    """The fp32 sum rounded to the input's dtype (as F.linear in that dtype leaves it), then stored in y's:
    an fp32 y (the logits) holds exactly that rounded value, with no conversion kernel after."""
    return acc.to(x_ptr.dtype.element_ty).to(y_ptr.dtype.element_ty)


@triton.jit
def _tile(N, K, KS, BN: tl.constexpr):
    """Program (row block, split)'s (row block, its rows, their mask, first column, columns)."""
    rb = tl.program_id(0)
    rows = rb * BN + tl.arange(0, BN)
    k0 = tl.program_id(1) * KS
    return rb, rows, rows < N, k0, tl.minimum(KS, K - k0)


@triton.jit
def _dense_gemv_kernel(x_ptr, s_xm, w_ptr, s_wr, y_ptr, s_ym, part_ptr, count_ptr, N, K, T, KS,
                       BN: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr, SILU_GLU: tl.constexpr,
                       PDL: tl.constexpr, PREFETCH: tl.constexpr):
    """Program (row block, split s): rows · x over columns s·KS .. s·KS+KS-1 (with SILU_GLU, x holds
    gate | up, K each, and the product takes SiLU(gate)·up). With SPLIT > 1 each split stores its fp32
    partial and the last of a row block's splits to arrive (ops/arrival.py) sums them in split order (the
    same order whichever arrives last) and stores y. PDL: launched while the kernel before it runs (which
    makes x); the weight is no kernel's output, so with PREFETCH the program asks its rows into L2
    first, and every read of x, partials or counters and every store comes after the wait."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    rb, rows, rmask, k0, kd = _tile(N, K, KS, BN)
    if PDL:
        if PREFETCH:
            nbytes = kd * (w_ptr.dtype.element_ty.primitive_bitwidth // 8)
            for i in tl.static_range(BN):
                prefetch_l2(w_ptr + tl.minimum(rb * BN + i, N - 1).to(tl.int64) * s_wr + k0, nbytes)
        tl.extra.cuda.gdc_wait()
    for t in range(T):
        acc = _gemv_rows(w_ptr, k0, s_wr, rows, rmask, x_ptr + t * s_xm + k0, kd, K, SILU_GLU, BN, BK)
        if SPLIT == 1:
            tl.store(y_ptr + t * s_ym + rows, _rounded(acc, x_ptr, y_ptr), mask=rmask)
        else:
            tl.store(part_ptr + (tl.program_id(1) * T + t) * N + rows, acc, mask=rmask)
    if SPLIT > 1:
        tl.debug_barrier()  # every thread's partial stores before the one release below
        before = tl.atomic_add(count_ptr + rb, 1, sem="acq_rel", scope="gpu")
        if before == SPLIT - 1:
            tl.debug_barrier()
            for t in range(T):
                tot = tl.zeros([BN], tl.float32)
                for j in tl.static_range(SPLIT):  # ".cg": past L1, which may hold lines older than the partials
                    tot += tl.load(part_ptr + (j * T + t) * N + rows, mask=rmask, other=0.0, cache_modifier=".cg")
                tl.store(y_ptr + t * s_ym + rows, _rounded(tot, x_ptr, y_ptr), mask=rmask)
            tl.store(count_ptr + rb, 0)  # the next launch on the stream starts after this one ends


def _splits(x: torch.Tensor, y: torch.Tensor, n: int, k: int, bn: int, bk: int, split: int):
    """(columns a split, splits, row blocks, the fp32 partials, the arrival counters) of a split-K launch
    over x's rows; without a split both buffers are y (unused)."""
    ks = triton.cdiv(triton.cdiv(k, split), bk) * bk  # whole column blocks per split
    split = triton.cdiv(k, ks)
    blocks = triton.cdiv(n, bn)
    part = torch.empty(split * x.shape[0], n, dtype=torch.float32, device=x.device) if split > 1 else y
    count = arrival_counters(x.device, blocks) if split > 1 else y
    return ks, split, blocks, part, count


def gemv(x: torch.Tensor, weight: torch.Tensor, config: GemvConfig | None = None,
         silu_glu: bool = False, out: torch.Tensor | None = None, pdl: bool | None = None) -> torch.Tensor:
    """x [T, K] @ weight[N, K]ᵀ -> [T, N] in x's dtype, fp32 accumulation. `config` (BLOCK_N, BLOCK_K, warps,
    stages, splits of K; None: `kernel_plan.gemv_config` for x's device): a long input over few output rows
    fills the SMs only when split. With silu_glu,
    x is [T, 2K] gate | up and the product is with SiLU(gate)·up rounded to x's dtype (the SiLU-GLU of
    `GLU`), computed as the rows are read. `out` [T, N] (e.g. fp32, unit-stride rows): written in place
    with the values rounded to x's dtype, and returned. pdl (default: `PDL` on a GPU of compute
    capability 9+): launched as a programmatic dependent of the kernel before it."""
    t, k = x.shape[0], weight.shape[1]
    n = weight.shape[0]
    x = x if x.stride(-1) == 1 else x.contiguous()
    assert weight.stride(-1) == 1 and x.shape[1] == (2 * k if silu_glu else k)
    y = torch.empty(t, n, dtype=x.dtype, device=x.device) if out is None else out
    assert y.shape == (t, n) and y.stride(-1) == 1
    if config is None:
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 132
        config = gemv_config(n, k, silu_glu, sms)
    bn, bk, warps, stages, split = config
    ks, split, blocks, part, count = _splits(x, y, n, k, bn, bk, split)
    pdl = use_pdl(x, pdl, PDL)
    es = weight.element_size()
    # the bulk prefetch takes 16-byte aligned spans of whole 16 bytes
    prefetch = (pdl and weight.numel() * es <= PREFETCH_MAX_BYTES and weight.data_ptr() % 16 == 0
                and (weight.stride(0) * es) % 16 == 0 and (ks * es) % 16 == 0 and (k * es) % 16 == 0)
    if t:
        _dense_gemv_kernel[(blocks, split)](
            x, x.stride(0), weight, weight.stride(0), y, y.stride(0), part, count, n, k, t, ks, BN=bn, BK=bk,
            SPLIT=split, SILU_GLU=silu_glu, PDL=pdl, PREFETCH=prefetch, num_warps=warps, num_stages=stages,
            **({"launch_pdl": True} if pdl else {}),
        )
    return y


def linear(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None,
           config: GemvConfig | None = None) -> torch.Tensor:
    """F.linear without bias, or `gemv` with the tiles `config` when the kernel plan gives them (one token
    of a 16-bit dtype on the GPU: `KernelPlan.linear_gemv`). `out` (any float dtype): receives the result
    in x's dtype's values (the logits buffer: the GEMV stores into it directly, one conversion kernel
    fewer)."""
    if config is not None:
        return gemv(x, weight, config, out=out)
    y = F.linear(x, weight)
    return y if out is None else out.copy_(y)


@triton.jit
def _dense_tokens_kernel(x_ptr, s_xm, w_ptr, s_wr, y_ptr, s_ym, part_ptr, count_ptr, N, K, T, KS,
                         TP: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr,
                         PRECISION: tl.constexpr, PDL: tl.constexpr):
    """Program (row block, split s): like `_dense_gemv_kernel`, for T <= TP tokens at once: each weight
    tile is loaded once and multiplied by the T rows of x in one tensor-core dot ([TP, BK] x [BK, BN],
    rows past T zero), where the per-token loop re-reads the tile T times."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    rb, rows, rmask, k0, kd = _tile(N, K, KS, BN)
    tt = tl.arange(0, TP)
    tmask = tt < T
    if PDL:
        tl.extra.cuda.gdc_wait()
    acc = tl.zeros([TP, BN], tl.float32)
    for c0 in range(0, kd, BK):
        local = c0 + tl.arange(0, BK)
        cm = local < kd
        cols = k0 + local
        w = tl.load(w_ptr + rows[:, None].to(tl.int64) * s_wr + cols[None, :], mask=rmask[:, None] & cm[None, :],
                    other=0.0)
        xv = tl.load(x_ptr + tt[:, None] * s_xm + cols[None, :], mask=tmask[:, None] & cm[None, :], other=0.0)
        acc = tl.dot(xv, tl.trans(w), acc, input_precision=PRECISION)
    live = tmask[:, None] & rmask[None, :]
    if SPLIT == 1:
        tl.store(y_ptr + tt[:, None] * s_ym + rows[None, :], _rounded(acc, x_ptr, y_ptr), mask=live)
    else:
        parts = part_ptr + (tl.program_id(1) * T + tt[:, None]) * N + rows[None, :]
        tl.store(parts, acc, mask=live)
        tl.debug_barrier()  # every thread's partial stores before the one release below
        before = tl.atomic_add(count_ptr + rb, 1, sem="acq_rel", scope="gpu")
        if before == SPLIT - 1:
            tl.debug_barrier()
            tot = tl.zeros([TP, BN], tl.float32)
            for j in tl.static_range(SPLIT):  # in split order, whichever split arrives last
                tot += tl.load(part_ptr + (j * T + tt[:, None]) * N + rows[None, :], mask=live, other=0.0,
                               cache_modifier=".cg")
            tl.store(y_ptr + tt[:, None] * s_ym + rows[None, :], _rounded(tot, x_ptr, y_ptr), mask=live)
            tl.store(count_ptr + rb, 0)


# the most tokens `gemv_tokens` takes in one dot (a verify step of up to 15 drafts)
TOKENS_MAX = 16


def gemv_tokens(x: torch.Tensor, weight: torch.Tensor, config: GemvConfig, out: torch.Tensor | None = None,
                pdl: bool | None = None) -> torch.Tensor:
    """x [T, K] @ weight[N, K]ᵀ -> [T, N] for 1 <= T <= TOKENS_MAX tokens (a verify step's rows), the
    weight streamed once: `gemv`'s contract (config, out, pdl) without the SiLU-GLU. fp32 inputs multiply
    in IEEE fp32, 16-bit ones on tensor cores with fp32 accumulation."""
    t, k = x.shape[0], weight.shape[1]
    n = weight.shape[0]
    if not 1 <= t <= TOKENS_MAX or x.shape[1] != k or x.dtype != weight.dtype:
        raise ValueError(f"gemv_tokens: 1 to {TOKENS_MAX} rows of the weight's dtype and width")
    x = x if x.stride(-1) == 1 else x.contiguous()
    assert weight.stride(-1) == 1
    y = torch.empty(t, n, dtype=x.dtype, device=x.device) if out is None else out
    assert y.shape == (t, n) and y.stride(-1) == 1
    bn, bk, warps, stages, split = config
    bn, bk = max(16, bn), max(16, bk)  # a tensor-core dot's smallest tile
    ks, split, blocks, part, count = _splits(x, y, n, k, bn, bk, split)
    pdl = use_pdl(x, pdl, PDL)
    _dense_tokens_kernel[(blocks, split)](
        x, x.stride(0), weight, weight.stride(0), y, y.stride(0), part, count, n, k, t, ks,
        TP=max(16, triton.next_power_of_2(t)), BN=bn, BK=bk, SPLIT=split,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", PDL=pdl, num_warps=warps, num_stages=stages,
        **({"launch_pdl": True} if pdl else {}),
    )
    return y
