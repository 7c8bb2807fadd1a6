"""Routed experts for a few tokens (decode) as two Triton GEMV kernels that read only the selected
experts' rows (docs/ARCHITECTURE.md §7). `torch._grouped_mm` costs about 0.5 ms per call at 1-8 tokens on an H200
whatever the token count (measured 2026-11-30), which is 26 MoE layers × 0.5 ms per decode step.

Both kernels run one program per (token-expert pair, block of rows): many programs per SM keep enough
loads in flight. The down kernel applies the SiLU-GLU to its pair's gate|up row as it reads it and
scales by the routing weight; a third small kernel sums each token's pairs in a fixed order (no
atomics, so the result does not depend on scheduling) and casts. Three launches replace the
activation's casts, the reduction and the add that followed them.

A shared expert of the same width as the routed ones (Kimi Linear, DeepSeek) rides along as a last pair
of weight 1 per token. This takes the place of three cuBLAS GEMV calls per layer, which at 1024 output
rows fill only 16 of the H200's 132 SMs (13.5 µs per call against about 3 µs at copy speed; profiled
2026-11-30). Its weights are read where they lie, through their element offsets from the routed
weights' base pointer: one scalar base per program. (Three masked loads per tile, one per tensor, ran
the up kernel at 1.9 TB/s against 3.1 for one load.)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from hyserve.ops.dispatch import sm90
from hyserve.ops.kernel_plan import MOE_GEMV_SMALL_PAIRS
from hyserve.ops.ptx import prefetch_l2


@triton.jit
def _gemv_rows(w_ptr, base, s_wr, rows, rmask, v_ptr, Kdim, up_off, SILU_GLU: tl.constexpr, BN: tl.constexpr,
               BK: tl.constexpr):
    """Σ_c w[base + r·s_wr + c] · v[c] for c < Kdim and the rows r, fp32. With SILU_GLU, v is the gate
    and v + up_off the up values, and the activation is applied, rounded to v's dtype as the torch GLU
    rounds it. (A [BN, BK]
    accumulator reduced once after the loop measured slower on the MoE GEMVs on an H200, and helped no
    dense single-token shape past cuBLAS; 2026-11-30.)"""
    acc = tl.zeros([BN], tl.float32)
    wrows = w_ptr + base + rows[:, None] * s_wr
    for c0 in range(0, Kdim, BK):
        cols = c0 + tl.arange(0, BK)
        cm = cols < Kdim
        if SILU_GLU:
            g = tl.load(v_ptr + cols, mask=cm, other=0.0).to(tl.float32)
            u = tl.load(v_ptr + up_off + cols, mask=cm, other=0.0).to(tl.float32)
            v = (g * tl.sigmoid(g) * u).to(v_ptr.dtype.element_ty).to(tl.float32)
        else:
            v = tl.load(v_ptr + cols, mask=cm, other=0.0).to(tl.float32)
        w = tl.load(wrows + cols[None, :], mask=rmask[:, None] & cm[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(w * v[None, :], axis=1)
    return acc


@triton.jit
def _up_kernel(
    x_ptr, s_xm, w_ptr, s_we, s_wr, ids_ptr, gate_off, up_off, h_ptr, s_hm, inter, Kdim,
    K_ROUTED: tl.constexpr, SHARED: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr,
):
    """h[p] = w13[e_p] · x[t_p] over 2·inter rows. Pairs run a token's k routed experts, then (SHARED)
    the shared expert, whose gate and up rows lie gate_off / up_off elements from w_ptr."""
    if PDL:  # the down kernel may be scheduled now: it prefetches its weights, then waits for this grid
        tl.extra.cuda.gdc_launch_dependents()
    p = tl.program_id(0)
    rb = tl.program_id(1)
    pairs: tl.constexpr = K_ROUTED + SHARED
    t = p // pairs
    j = p % pairs
    e = tl.load(ids_ptr + t * K_ROUTED + tl.minimum(j, K_ROUTED - 1)).to(tl.int64)
    base = e * s_we
    if SHARED:  # inter is a multiple of BN (the caller sees to it): a block is all gate or all up rows
        shared_base = tl.where(rb * BN < inter, gate_off.to(tl.int64), up_off.to(tl.int64) - inter * s_wr)
        base = tl.where(j == K_ROUTED, shared_base, base)
    rows = rb * BN + tl.arange(0, BN)
    rmask = rows < 2 * inter
    acc = _gemv_rows(w_ptr, base, s_wr, rows, rmask, x_ptr + t * s_xm, Kdim, 0, False, BN, BK)
    tl.store(h_ptr + p * s_hm + rows, acc.to(h_ptr.dtype.element_ty), mask=rmask)


@triton.jit
def _down_kernel(
    a_ptr, s_am, w_ptr, s_we, s_wr, ids_ptr, wts_ptr, down_off, part_ptr, s_pm, N, inter, row_bytes,
    K_ROUTED: tl.constexpr, SHARED: tl.constexpr, SILU_GLU: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    PDL: tl.constexpr,
):
    """part[p] = wt_p · w2[e_p] · a[p], fp32; the shared pair (weight 1) lies down_off elements from w_ptr.
    With PDL the kernel is launched while the up kernel still runs: the expert ids and weights are older
    than that kernel, so a program reads them and asks for its weight rows in L2 before it waits for the
    up kernel's output."""
    p = tl.program_id(0)
    rb = tl.program_id(1)
    pairs: tl.constexpr = K_ROUTED + SHARED
    t = p // pairs
    j = p % pairs
    jr = tl.minimum(j, K_ROUTED - 1)
    e = tl.load(ids_ptr + t * K_ROUTED + jr).to(tl.int64)
    wt = tl.load(wts_ptr + t * K_ROUTED + jr).to(tl.float32)
    base = e * s_we
    if SHARED:
        base = tl.where(j == K_ROUTED, down_off.to(tl.int64), base)
        wt = tl.where(j == K_ROUTED, 1.0, wt)
    rows = rb * BN + tl.arange(0, BN)
    rmask = rows < N
    if PDL:
        for i in tl.static_range(BN):
            prefetch_l2(w_ptr + base + tl.minimum(rb * BN + i, N - 1) * s_wr, row_bytes)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    acc = _gemv_rows(w_ptr, base, s_wr, rows, rmask, a_ptr + p * s_am, inter, inter, SILU_GLU, BN, BK)
    tl.store(part_ptr + p * s_pm + rows, acc * wt, mask=rmask)


@triton.jit
def _sum_pairs_kernel(part_ptr, s_pm, out_ptr, s_om, N, wts_ptr, PAIRS: tl.constexpr, BLOCK: tl.constexpr,
                      WEIGHTED: tl.constexpr, PDL: tl.constexpr):
    """out[t] = Σ_j part[t·PAIRS + j] (× wts[t·PAIRS + j] with WEIGHTED) in fp32 in order j = 0, 1, ...,
    cast to out's dtype."""
    if PDL:  # launched early: wait for the kernel before it
        tl.extra.cuda.gdc_wait()
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < N
    acc = tl.zeros([BLOCK], tl.float32)
    for j in tl.static_range(PAIRS):
        part = tl.load(part_ptr + (t * PAIRS + j) * s_pm + cols, mask=m, other=0.0).to(tl.float32)
        if WEIGHTED:
            part = part * tl.load(wts_ptr + t * PAIRS + j)
        acc += part
    tl.store(out_ptr + t * s_om + cols, acc.to(out_ptr.dtype.element_ty), mask=m)


def sum_pairs(part: torch.Tensor, pairs: int, out_dtype: torch.dtype, weights: torch.Tensor | None = None,
              pdl: bool = False) -> torch.Tensor:
    """part [T·pairs, N] -> [T, N]: each token's pairs summed in fp32 in pair order (weighted by weights
    [T·pairs] fp32 if given), one launch (with pdl, as a programmatic dependent of the kernel before it)."""
    n = part.shape[1]
    t = part.shape[0] // pairs
    out = torch.empty(t, n, dtype=out_dtype, device=part.device)
    block = min(1024, triton.next_power_of_2(n))
    if t:
        _sum_pairs_kernel[(t, triton.cdiv(n, block))](
            part, part.stride(0), out, out.stride(0), n, weights if weights is not None else part, PAIRS=pairs,
            BLOCK=block, WEIGHTED=weights is not None, PDL=pdl, num_warps=4, **({"launch_pdl": True} if pdl else {}),
        )
    return out


def _offset(t: torch.Tensor, base: torch.Tensor) -> int:
    """t's start in elements from base's: how the kernels reach the shared weights from w_ptr."""
    delta = t.data_ptr() - base.data_ptr()
    assert t.dtype == base.dtype and delta % base.element_size() == 0
    return delta // base.element_size()


def shared_fits(shared, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """Whether a shared expert (a DenseMLP) can run as the last pair: same width, dtype and row layout as
    the routed experts."""
    parts = (shared.gate_proj.weight, shared.up_proj.weight, shared.down_proj.weight)
    inter, d = w13.shape[1] // 2, w13.shape[2]
    return (
        parts[0].shape == parts[1].shape == (inter, d) and parts[2].shape == (d, inter)
        and w13.stride(1) == d and w2.stride(1) == inter  # the routed rows' strides serve the shared rows
        and all(p.dtype == w13.dtype and p.device == w13.device and p.is_contiguous() for p in parts)
    )


@dataclass(frozen=True)
class PairParts:
    """The down kernel's fp32 per-pair outputs [T·pairs, D], not yet summed: the residual add + RMSNorm
    kernel that follows a decode MoE sums them itself (ops/rms_norm), one launch fewer. `pdl`: the next
    kernel may be a programmatic dependent of the down kernel."""

    part: torch.Tensor
    pairs: int
    dtype: torch.dtype
    pdl: bool

    def sum(self) -> torch.Tensor:
        """[T, D] in `dtype`, as `experts_forward_gemv` returns it."""
        return sum_pairs(self.part, self.pairs, self.dtype, pdl=self.pdl)


def experts_forward_gemv(
    x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
    act: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], shared=None,
    up: tuple[int, int, int, int] | None = None, down: tuple[int, int, int, int] | None = None,
    pdl: bool | None = None, summed: bool = True,
) -> torch.Tensor | PairParts:
    """Same contract as `moe.experts_forward`, plus the shared expert's output when `shared` (a DenseMLP
    that `shared_fits`) is given. Meant for T·k up to a few dozen pairs. `up` and `down` are each
    kernel's (BLOCK_N rows, BLOCK_K, num_warps, num_stages). `pdl` (default: up to MOE_GEMV_SMALL_PAIRS = 16
    pairs (ops/kernel_plan.py) on a GPU of
    compute capability 9 or later) launches the down and sum kernels as programmatic dependents of the kernel
    before each, where the activation is read inside the down kernel (SiLU-GLU). summed=False returns the
    unsummed `PairParts` (tokens present) for the kernel after it to sum."""
    t, k = ids.shape
    # the best of a sweep on an H200 (48B shape with the shared expert, CUDA-graph replay): up 2.98 TB/s at
    # 1 token and 4.02 at 8; down 2.90 TB/s at 1 token, 3.60 at 8 with the smaller tile
    up = up or (32, 128, 8, 4)
    small = t * k <= MOE_GEMV_SMALL_PAIRS
    down = down or ((32, 256, 8, 3) if small else (16, 128, 4, 4))
    inter, d = w13.shape[1] // 2, w13.shape[2]
    if t == 0:
        return x.new_zeros(0, d)
    assert w13.stride(-1) == 1 and w2.stride(-1) == 1 and x.stride(-1) == 1
    pairs = k + (shared is not None)
    up_n, up_k, up_warps, up_stages = up
    while shared is not None and inter % up_n:  # a shared row block must be all gate or all up rows
        up_n //= 2
    ids, weights = ids.contiguous(), weights.contiguous()
    offs = (0, 0, 0)
    if shared is not None:
        offs = (_offset(shared.gate_proj.weight, w13), _offset(shared.up_proj.weight, w13),
                _offset(shared.down_proj.weight, w2))
    h = torch.empty(t * pairs, 2 * inter, dtype=x.dtype, device=x.device)
    silu = getattr(act, "kind", None) == "silu"
    # PDL measured 1.03x at 1 token and 0.93x at 8 (48B shape, H200 graph replays, 2026-11-30)
    pdl = small and _pdl_ok(x, w2, shared) if pdl is None else pdl
    pdl = pdl and silu and x.is_cuda  # PTX only: the CPU interpreter never sees it
    _up_kernel[(t * pairs, triton.cdiv(2 * inter, up_n))](
        x, x.stride(0), w13, w13.stride(0), w13.stride(1), ids, offs[0], offs[1], h, h.stride(0), inter, d,
        K_ROUTED=k, SHARED=shared is not None, BN=up_n, BK=up_k, PDL=pdl, num_warps=up_warps, num_stages=up_stages,
    )
    a = h if silu else act(h[:, :inter], h[:, inter:]).contiguous()
    part = torch.empty(t * pairs, d, dtype=torch.float32, device=x.device)
    block_n, block_k, num_warps, num_stages = down
    _down_kernel[(t * pairs, triton.cdiv(d, block_n))](
        a, a.stride(0), w2, w2.stride(0), w2.stride(1), ids, weights, offs[2], part, part.stride(0), d, inter,
        inter * w2.element_size(), K_ROUTED=k, SHARED=shared is not None, SILU_GLU=silu, BN=block_n, BK=block_k, PDL=pdl, num_warps=num_warps,
        num_stages=num_stages, **({"launch_pdl": True} if pdl else {}),
    )
    parts = PairParts(part, pairs, x.dtype, pdl)
    return parts if not summed else parts.sum()


def _pdl_ok(x: torch.Tensor, w2: torch.Tensor, shared) -> bool:
    """Programmatic dependent launch (sm_90+) and down-weight rows the L2 prefetch can take (16-byte aligned
    starts and lengths)."""
    starts = [w2] + ([shared.down_proj.weight] if shared is not None else [])
    return (sm90(x)
            and w2.shape[2] * w2.element_size() % 16 == 0 and w2.stride(1) * w2.element_size() % 16 == 0
            and w2.stride(0) * w2.element_size() % 16 == 0 and all(t.data_ptr() % 16 == 0 for t in starts))
