"""Routed experts for a few tokens (decode) as two Triton GEMV kernels that read only the selected
experts' rows (DESIGN.md §6). `torch._grouped_mm` costs about 0.5 ms per call at 1-8 tokens on an H200
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

The shared pair does not depend on the router, so in a captured decode step (`gemv_start`) it is launched
alone on a side stream before the router, and the routed pairs alone after it; both write the rows the
all-pairs launches write, and one sum after the join reads them in the same order (bit-identical).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from hyserve.ops.dispatch import sm90
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
def _pair(p, K_ROUTED: tl.constexpr, SHARED: tl.constexpr, RUN_ROUTED: tl.constexpr, RUN_SHARED: tl.constexpr):
    """Program row p's token t, pair j (j == K_ROUTED: the shared expert) and row q of h and part. A launch
    of only the routed or only the shared pairs has a grid of just those, and writes the same rows as the
    launch of all pairs, so that one sum reads them in the same order."""
    pairs: tl.constexpr = K_ROUTED + SHARED
    if not RUN_ROUTED:
        t = p
        j = p * 0 + K_ROUTED
    elif not RUN_SHARED:
        t = p // K_ROUTED
        j = p % K_ROUTED
    else:
        t = p // pairs
        j = p % pairs
    return t, j, t * pairs + j


@triton.jit
def _up_kernel(
    x_ptr, s_xm, w_ptr, s_we, s_wr, ids_ptr, gate_off, up_off, h_ptr, s_hm, inter, Kdim,
    K_ROUTED: tl.constexpr, SHARED: tl.constexpr, RUN_ROUTED: tl.constexpr, RUN_SHARED: tl.constexpr,
    BN: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr,
):
    """h[q] = w13[e_p] · x[t_p] over 2·inter rows. Pairs run a token's k routed experts, then (SHARED)
    the shared expert, whose gate and up rows lie gate_off / up_off elements from w_ptr. RUN_ROUTED and
    RUN_SHARED pick the pairs this launch runs (the shared pair alone never reads ids_ptr)."""
    if PDL:  # the down kernel may be scheduled now: it prefetches its weights, then waits for this grid
        tl.extra.cuda.gdc_launch_dependents()
    rb = tl.program_id(1)
    t, j, q = _pair(tl.program_id(0), K_ROUTED, SHARED, RUN_ROUTED, RUN_SHARED)
    if RUN_SHARED:  # inter is a multiple of BN (the caller sees to it): a block is all gate or all up rows
        shared_base = tl.where(rb * BN < inter, gate_off.to(tl.int64), up_off.to(tl.int64) - inter * s_wr)
    if RUN_ROUTED:
        e = tl.load(ids_ptr + t * K_ROUTED + tl.minimum(j, K_ROUTED - 1)).to(tl.int64)
        base = e * s_we
        if RUN_SHARED:
            base = tl.where(j == K_ROUTED, shared_base, base)
    else:
        base = shared_base
    rows = rb * BN + tl.arange(0, BN)
    rmask = rows < 2 * inter
    acc = _gemv_rows(w_ptr, base, s_wr, rows, rmask, x_ptr + t * s_xm, Kdim, 0, False, BN, BK)
    tl.store(h_ptr + q * s_hm + rows, acc.to(h_ptr.dtype.element_ty), mask=rmask)


@triton.jit
def _down_kernel(
    a_ptr, s_am, w_ptr, s_we, s_wr, ids_ptr, wts_ptr, down_off, part_ptr, s_pm, N, inter, row_bytes,
    K_ROUTED: tl.constexpr, SHARED: tl.constexpr, RUN_ROUTED: tl.constexpr, RUN_SHARED: tl.constexpr,
    SILU_GLU: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr,
):
    """part[q] = wt_p · w2[e_p] · a[q], fp32; the shared pair (weight 1) lies down_off elements from w_ptr.
    With PDL the kernel is launched while the up kernel still runs: the expert ids and weights are older
    than that kernel, so a program reads them and asks for its weight rows in L2 before it waits for the
    up kernel's output."""
    rb = tl.program_id(1)
    t, j, q = _pair(tl.program_id(0), K_ROUTED, SHARED, RUN_ROUTED, RUN_SHARED)
    if RUN_ROUTED:
        jr = tl.minimum(j, K_ROUTED - 1)
        e = tl.load(ids_ptr + t * K_ROUTED + jr).to(tl.int64)
        wt = tl.load(wts_ptr + t * K_ROUTED + jr).to(tl.float32)
        base = e * s_we
        if RUN_SHARED:
            base = tl.where(j == K_ROUTED, down_off.to(tl.int64), base)
            wt = tl.where(j == K_ROUTED, 1.0, wt)
    else:
        base = down_off.to(tl.int64)
        wt = 1.0
    rows = rb * BN + tl.arange(0, BN)
    rmask = rows < N
    if PDL:
        for i in tl.static_range(BN):
            prefetch_l2(w_ptr + base + tl.minimum(rb * BN + i, N - 1) * s_wr, row_bytes)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    acc = _gemv_rows(w_ptr, base, s_wr, rows, rmask, a_ptr + q * s_am, inter, inter, SILU_GLU, BN, BK)
    tl.store(part_ptr + q * s_pm + rows, acc * wt, mask=rmask)


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


def experts_forward_gemv(
    x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
    act: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], shared=None,
    up: tuple[int, int, int, int] | None = None, down: tuple[int, int, int, int] | None = None,
    pdl: bool | None = None, split: bool | None = None,
) -> torch.Tensor:
    """Same contract as `moe.experts_forward`, plus the shared expert's output when `shared` (a DenseMLP
    that `shared_fits`) is given. Meant for T·k up to a few dozen pairs. `up` and `down` are each
    kernel's (BLOCK_N rows, BLOCK_K, num_warps, num_stages). `pdl` (default: up to 16 pairs on a GPU of
    compute capability 9 or later) launches the down and sum kernels as programmatic dependents of the kernel
    before each, where the activation is read inside the down kernel (SiLU-GLU). `split`: see `gemv_start`."""
    return gemv_start(x, ids.shape[1], w13, w2, act, shared, up, down, pdl, split).finish(ids, weights)


# Up to this many tokens a decode step captured in a CUDA graph runs the shared expert's pair on a side
# stream, concurrently with the router: the router's two small kernels leave HBM idle for about 6 µs per
# layer (H200), about what the shared pair's 14 MB take at 1 token. A guess, to be measured: at more tokens
# the shared pair grows while the router's window does not.
SIDE_STREAM_MAX_TOKENS = 4

_side_streams: dict[torch.device, torch.cuda.Stream] = {}


@dataclass
class GemvRun:
    """One call's settings and buffers between `gemv_start` and `finish`."""

    x: torch.Tensor
    w13: torch.Tensor
    w2: torch.Tensor
    act: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    k: int
    shared: bool
    offs: tuple[int, int, int]
    up: tuple[int, int, int, int]
    down: tuple[int, int, int, int]
    silu: bool
    pdl: bool
    split: bool  # the shared pair was launched by gemv_start
    side: torch.cuda.Stream | None  # where it runs, if not on the current stream: finish joins it
    h: torch.Tensor
    part: torch.Tensor

    def finish(self, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The routed pairs (and the shared one unless split), then each token's pairs summed."""
        if not self.x.shape[0]:
            return self.x.new_zeros(0, self.w13.shape[2])
        ids, weights = ids.contiguous(), weights.contiguous()
        run_shared = self.shared and not self.split
        self._up(ids, True, run_shared, self.pdl)
        inter = self.w13.shape[1] // 2
        a = self.h if self.silu else self.act(self.h[:, :inter], self.h[:, inter:]).contiguous()
        self._down(a, ids, weights, True, run_shared, self.pdl)
        if self.side is not None:
            torch.cuda.current_stream(self.x.device).wait_stream(self.side)
        # with PDL the sum would depend programmatically on the routed down kernel; after the join it also
        # waits for the side stream, so it launches plainly
        return sum_pairs(self.part, self.k + self.shared, self.x.dtype, pdl=self.pdl and self.side is None)

    def _up(self, ids: torch.Tensor, routed: bool, shared: bool, pdl: bool) -> None:
        x, w13, h = self.x, self.w13, self.h
        up_n, up_k, up_warps, up_stages = self.up
        grid = (x.shape[0] * (self.k * routed + shared), triton.cdiv(h.shape[1], up_n))
        _up_kernel[grid](
            x, x.stride(0), w13, w13.stride(0), w13.stride(1), ids, self.offs[0], self.offs[1], h, h.stride(0),
            h.shape[1] // 2, x.shape[1], K_ROUTED=self.k, SHARED=self.shared, RUN_ROUTED=routed, RUN_SHARED=shared,
            BN=up_n, BK=up_k, PDL=pdl, num_warps=up_warps, num_stages=up_stages,
        )

    def _down(self, a: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, routed: bool, shared: bool,
              pdl: bool) -> None:
        w2, part = self.w2, self.part
        block_n, block_k, num_warps, num_stages = self.down
        d, inter = w2.shape[1], w2.shape[2]
        _down_kernel[(self.x.shape[0] * (self.k * routed + shared), triton.cdiv(d, block_n))](
            a, a.stride(0), w2, w2.stride(0), w2.stride(1), ids, weights, self.offs[2], part, part.stride(0), d,
            inter, inter * w2.element_size(), K_ROUTED=self.k, SHARED=self.shared, RUN_ROUTED=routed,
            RUN_SHARED=shared, SILU_GLU=self.silu, BN=block_n, BK=block_k, PDL=pdl, num_warps=num_warps,
            num_stages=num_stages, **({"launch_pdl": True} if pdl else {}),
        )

    def _shared_pair(self) -> None:
        # plain launches (no PDL): on the side stream the kernel before each is not one it depends on
        # programmatically. The router has not run: h and part stand in for the ids and weights, unread
        self._up(self.h, False, True, False)
        self._down(self.h, self.h, self.part, False, True, False)


def gemv_start(
    x: torch.Tensor, k: int, w13: torch.Tensor, w2: torch.Tensor,
    act: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], shared=None,
    up: tuple[int, int, int, int] | None = None, down: tuple[int, int, int, int] | None = None,
    pdl: bool | None = None, split: bool | None = None,
) -> GemvRun:
    """`experts_forward_gemv` before the router has run, for k experts a token: the buffers (on the current
    stream) and, if `split`, the shared expert's pair, so that `finish(ids, weights)` launches only the
    routed pairs. `split` defaults to on for a SiLU-GLU shared pair of up to SIDE_STREAM_MAX_TOKENS tokens
    on CUDA; while a stream is being captured the shared pair runs on a side stream concurrently with the
    router, otherwise on the current stream. The sums are bit-identical either way."""
    t = x.shape[0]
    # the best of a sweep on an H200 (48B shape with the shared expert, CUDA-graph replay): up 2.98 TB/s at
    # 1 token and 4.02 at 8; down 2.90 TB/s at 1 token, 3.60 at 8 with the smaller tile
    up = up or (32, 128, 8, 4)
    down = down or ((32, 256, 8, 3) if t * k <= 16 else (16, 128, 4, 4))
    inter, d = w13.shape[1] // 2, w13.shape[2]
    assert w13.stride(-1) == 1 and w2.stride(-1) == 1 and x.stride(-1) == 1
    up_n = up[0]
    while shared is not None and inter % up_n:  # a shared row block must be all gate or all up rows
        up_n //= 2
    offs = (0, 0, 0)
    if shared is not None:
        offs = (_offset(shared.gate_proj.weight, w13), _offset(shared.up_proj.weight, w13),
                _offset(shared.down_proj.weight, w2))
    silu = getattr(act, "kind", None) == "silu"
    # PDL measured 1.03x at 1 token and 0.93x at 8 (48B shape, H200 graph replays, 2026-11-30)
    pdl = t * k <= 16 and _pdl_ok(x, w2, shared) if pdl is None else pdl
    pdl = pdl and silu and x.is_cuda  # PTX only: the CPU interpreter never sees it
    if split is None:
        # eager steps split too (on one stream), so the kernels a capture replays are built before it:
        # Triton cannot load a module while a stream is being captured
        split = shared is not None and silu and x.is_cuda and 0 < t <= SIDE_STREAM_MAX_TOKENS
    split = split and shared is not None and t > 0
    assert not split or silu, "the split launches fuse the activation into the down kernel"
    pairs = k + (shared is not None)
    capturing = split and x.is_cuda and torch.cuda.is_current_stream_capturing()
    run = GemvRun(
        x, w13, w2, act, k, shared is not None, offs, (up_n, *up[1:]), down, silu, pdl, split,
        _side_stream(x.device) if capturing else None,
        torch.empty(t * pairs, 2 * inter, dtype=x.dtype, device=x.device),
        torch.empty(t * pairs, d, dtype=torch.float32, device=x.device),
    )
    if run.side is not None:  # h and part were allocated on this stream, which the side stream joins back
        run.side.wait_stream(torch.cuda.current_stream(x.device))
        with torch.cuda.stream(run.side):
            run._shared_pair()
    elif split:
        run._shared_pair()
    return run


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    if device not in _side_streams:
        _side_streams[device] = torch.cuda.Stream(device)
    return _side_streams[device]


def _pdl_ok(x: torch.Tensor, w2: torch.Tensor, shared) -> bool:
    """Programmatic dependent launch (sm_90+) and down-weight rows the L2 prefetch can take (16-byte aligned
    starts and lengths)."""
    starts = [w2] + ([shared.down_proj.weight] if shared is not None else [])
    return (sm90(x)
            and w2.shape[2] * w2.element_size() % 16 == 0 and w2.stride(1) * w2.element_size() % 16 == 0
            and w2.stride(0) * w2.element_size() % 16 == 0 and all(t.data_ptr() % 16 == 0 for t in starts))
