"""Routed experts as Triton grouped GEMMs: the kernel plan's choice past the decode GEMV for 16-bit
activations on every GPU (faster than `torch._grouped_mm`, which needs bf16 on sm90+; docs/ARCHITECTURE.md
§7). Same contract as `moe.experts_forward`.

The (token, expert) pairs are sorted by expert, and each expert's run is padded to whole tiles of BM
pairs, so every tile of a GEMM belongs to one expert: a tile multiplies its BM token rows by that
expert's weight block with tl.dot. The layout is built on the device, with no host synchronisation,
and the grid is sized for the worst case (every expert's last tile partial); tiles past the real end
return at once. So the path can run inside a CUDA graph.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from hyserve.ops.kernel_plan import MOE_TENSOR_CORE_PAIRS_PER_EXPERT
from hyserve.ops.moe_gemv import sum_pairs


@triton.jit
def _grouped_kernel(
    a_ptr, s_am, w_ptr, s_we, s_wr, out_ptr, s_om, pair_ptr, tile_expert_ptr, used_ptr,
    n_pairs, N, Kdim, a_div,
    SILU_GLU: tl.constexpr, GLU_OUT: tl.constexpr, IEEE: tl.constexpr, EVEN: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):
    """out[p, n] = Σ_c a[p // a_div, c] · w[e, n, c] for the BM pairs p of this
    tile, e its expert. With SILU_GLU, a row holds gate|up (2·Kdim values) and the SiLU-GLU is applied
    to it first, rounded to a's dtype as the torch GLU rounds it. With GLU_OUT (the up GEMM of large
    batches), w holds gate rows 0..N-1 over up rows N..2N-1 and the tile writes SiLU(gate)·up for its
    columns, each product rounded to out's dtype first as the unfused GEMM would store it; the down GEMM
    then loads plain rows, which the compiler can pipeline (the SiLU on the load ran it at a third of the
    up GEMM's FLOP rate). EVEN: BN divides N and BK divides Kdim, so the weight loads carry no mask (the
    weight stream is all that a decode-sized tile costs)."""
    tile = tl.program_id(0)
    if tile * BM >= tl.load(used_ptr):
        return
    nb = tl.program_id(1)
    e = tl.load(tile_expert_ptr + tile).to(tl.int64)
    pairs = tl.load(pair_ptr + tile * BM + tl.arange(0, BM))
    valid = pairs < n_pairs
    arows = a_ptr + (tl.where(valid, pairs, 0) // a_div).to(tl.int64)[:, None] * s_am
    cols_n = nb * BN + tl.arange(0, BN)
    nmask = cols_n < N
    wrows = w_ptr + e * s_we + cols_n[None, :] * s_wr
    urows = wrows + N * s_wr
    acc = tl.zeros([BM, BN], tl.float32)
    acc_u = tl.zeros([BM, BN], tl.float32)
    for c0 in range(0, Kdim, BK):
        c = c0 + tl.arange(0, BK)
        cm = c < Kdim
        amask = valid[:, None] & cm[None, :]
        if SILU_GLU:
            g = tl.load(arows + c[None, :], mask=amask, other=0.0).to(tl.float32)
            u = tl.load(arows + Kdim + c[None, :], mask=amask, other=0.0).to(tl.float32)
            a = (g * tl.sigmoid(g) * u).to(a_ptr.dtype.element_ty)
        else:
            a = tl.load(arows + c[None, :], mask=amask, other=0.0)
        if EVEN:
            w = tl.load(wrows + c[:, None])
        else:
            w = tl.load(wrows + c[:, None], mask=cm[:, None] & nmask[None, :], other=0.0)
        if IEEE:  # fp32 weights (the CPU-parity presets) need exact products, not tf32
            acc += tl.dot(a, w, input_precision="ieee")
        else:
            acc += tl.dot(a, w)
        if GLU_OUT:
            if EVEN:
                wu = tl.load(urows + c[:, None])
            else:
                wu = tl.load(urows + c[:, None], mask=cm[:, None] & nmask[None, :], other=0.0)
            if IEEE:
                acc_u += tl.dot(a, wu, input_precision="ieee")
            else:
                acc_u += tl.dot(a, wu)
    if GLU_OUT:
        g = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
        u = acc_u.to(out_ptr.dtype.element_ty).to(tl.float32)
        acc = g * tl.sigmoid(g) * u
    out = out_ptr + tl.where(valid, pairs, 0).to(tl.int64)[:, None] * s_om + cols_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & nmask[None, :])


@triton.jit
def _layout_kernel(ids_ptr, n, pair_ptr, tile_expert_ptr, used_ptr,
                   BM: tl.constexpr, BLOCK: tl.constexpr, BLOCK_E: tl.constexpr, MAX_TILES: tl.constexpr):
    """One program per expert e: the histogram of all pairs' experts gives e's padded run, which starts
    after the padded runs of the experts below it; e's pairs go there in pair order, the rest of its last
    tile gets the padding id n, and its tiles are marked as e's. One launch replaces a sort, a bincount,
    two cumsums, a scatter and a searchsorted (a dozen kernels per MoE layer, and above 1,024 tokens a
    radix sort of 8 passes). The pairs are read BLOCK at a time, twice: the histogram, then the ranks."""
    e = tl.program_id(0)
    bins = tl.arange(0, BLOCK_E)
    counts = tl.zeros([BLOCK_E], tl.int32)
    for c0 in range(0, n, BLOCK):
        offs = c0 + tl.arange(0, BLOCK)
        live = offs < n
        ids = tl.load(ids_ptr + offs, mask=live, other=0).to(tl.int32)
        dead = tl.sum((~live).to(tl.int32), 0)
        counts += tl.histogram(ids, BLOCK_E) - tl.where(bins == 0, dead, 0)  # the padding counted as expert 0
    padded = (counts + BM - 1) // BM * BM
    ends = tl.cumsum(padded, 0)
    start = tl.sum(tl.where(bins == e, ends - padded, 0), 0)
    count = tl.sum(tl.where(bins == e, counts, 0), 0)
    base = start
    for c0 in range(0, n, BLOCK):
        offs = c0 + tl.arange(0, BLOCK)
        live = offs < n
        mine = live & (tl.load(ids_ptr + offs, mask=live, other=0).to(tl.int32) == e)
        rank = tl.cumsum(mine.to(tl.int32), 0) - 1
        tl.store(pair_ptr + base + rank, offs, mask=mine)
        base += tl.sum(mine.to(tl.int32), 0)
    pad = count + tl.arange(0, BM)
    tl.store(pair_ptr + start + pad, n, mask=pad < (count + BM - 1) // BM * BM)
    t = tl.arange(0, MAX_TILES)
    tl.store(tile_expert_ptr + start // BM + t, e, mask=t * BM < count)
    if e == 0:
        tl.store(used_ptr, tl.sum(padded, 0))


def max_tiles(n_pairs: int, num_experts: int, bm: int) -> int:
    """Σ_e ceil(c_e / bm) ≤ ceil(n / bm) + (experts with a pair), for any routing of n pairs."""
    return triton.cdiv(n_pairs, bm) + min(n_pairs, num_experts)


LAYOUT_BLOCK = 8192  # pairs a layout program holds at a time


def expert_tiles_triton(ids: torch.Tensor, num_experts: int, bm: int,
                        block: int = LAYOUT_BLOCK) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`expert_tiles` in one launch, for any number of pairs (pairs in pair order within an expert: each
    output row depends only on its own pair, so the order inside a tile changes no value)."""
    flat = ids.reshape(-1)
    n, dev = flat.numel(), flat.device
    tiles = max_tiles(n, num_experts, bm)
    pair_of_slot = torch.empty(tiles * bm, dtype=torch.int32, device=dev)
    tile_expert = torch.empty(tiles, dtype=torch.int32, device=dev)
    used = torch.empty(1, dtype=torch.int32, device=dev)
    block = min(triton.next_power_of_2(max(n, 16)), block)
    _layout_kernel[(num_experts,)](
        flat, n, pair_of_slot, tile_expert, used, BM=bm, BLOCK=block,
        BLOCK_E=triton.next_power_of_2(max(num_experts, 2)), MAX_TILES=triton.next_power_of_2(triton.cdiv(n, bm)),
        num_warps=4 if block <= 1024 else 8,
    )
    return pair_of_slot, tile_expert, used


def expert_tiles(ids: torch.Tensor, num_experts: int, bm: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pair ids in expert order, each expert's run padded to whole BM tiles, padding = T·k;
    the expert of each tile; the number of padded slots in use, on the device). The torch version of
    `expert_tiles_triton`, which the grouped GEMM uses."""
    flat = ids.reshape(-1)
    n, dev = flat.numel(), flat.device
    order = torch.argsort(flat, stable=True)
    # scatter_add_, not bincount: bincount reads its maximum back to the host, so no CUDA graph could hold it
    counts = torch.zeros(num_experts, dtype=torch.long, device=dev)
    counts.scatter_add_(0, flat.long(), torch.ones(n, dtype=torch.long, device=dev))
    padded = (counts + bm - 1) // bm * bm
    padded_end = torch.cumsum(padded, 0)
    start = torch.cumsum(counts, 0) - counts
    sorted_e = flat[order]
    rank = torch.arange(n, device=dev) - start[sorted_e]  # position within its expert's run
    slots = max_tiles(n, num_experts, bm) * bm
    pair_of_slot = torch.full((slots,), n, dtype=torch.long, device=dev)
    pair_of_slot[padded_end[sorted_e] - padded[sorted_e] + rank] = order
    tile_start = torch.arange(0, slots, bm, device=dev)
    tile_expert = torch.searchsorted(padded_end, tile_start, right=True).clamp_(max=num_experts - 1)
    return pair_of_slot, tile_expert, padded_end[-1:]


def experts_forward_triton(
    x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
    act: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], block_m: int | None = None,
    up: tuple[int, int, int, int] | None = None, down: tuple[int, int, int, int] | None = None,
    fuse_glu: bool | None = None,
) -> torch.Tensor:
    """y[t] = Σ_j weights[t, j] · w2_e(act(w1_e x, w3_e x)), e = ids[t, j]; fp32 sum, x's dtype out.
    `block_m` pairs per tile; `up` and `down` are each GEMM's (BLOCK_N, BLOCK_K, num_warps, num_stages);
    `fuse_glu` computes the SiLU-GLU in the up GEMM (SiLU only). Defaults: the best of sweeps on an H200
    at the 48B shape (bf16): 16-pair tiles that stream the touched experts at 4.0-4.2 TB/s for decode-sized
    batches; from 32 pairs per expert on, 128-pair tiles on the tensor cores (the up GEMM at 470 TFLOP/s
    for 8K tokens, the down GEMM at 410) with the GLU fused."""
    t, k = ids.shape
    e, inter, d = w13.shape[0], w13.shape[1] // 2, w13.shape[2]
    assert x.stride(-1) == 1 and w13.stride(-1) == 1 and w2.stride(-1) == 1
    if t == 0:
        return x.new_zeros(0, d)
    n_pairs = t * k
    silu = getattr(act, "kind", None) == "silu"
    large = n_pairs >= MOE_TENSOR_CORE_PAIRS_PER_EXPERT * e
    fuse_glu = silu and large if fuse_glu is None else fuse_glu and silu
    if x.element_size() == 2 and large:
        block_m, up, down = block_m or 128, up or (128, 64, 8, 4), down or (256, 64, 8, 4)
    elif x.element_size() == 2:
        block_m, up, down = block_m or 16, up or (128, 128, 4, 4), down or (128, 64, 4, 3)
    else:  # fp32 tiles of those sizes overflow shared memory
        block_m, up, down = block_m or 16, up or (64, 64, 4, 3), down or (64, 64, 4, 3)
    pair_of_slot, tile_expert, used = expert_tiles_triton(ids, e, block_m)
    tiles = pair_of_slot.numel() // block_m
    wts = weights.reshape(-1).float().contiguous()
    flags = dict(IEEE=x.dtype == torch.float32, BM=block_m)
    bn, bk, warps, stages = up
    n_up = inter if fuse_glu else 2 * inter  # output columns: act (GLU fused) or gate|up
    h = torch.empty(n_pairs, n_up, dtype=x.dtype, device=x.device)
    _grouped_kernel[(tiles, triton.cdiv(n_up, bn))](
        x, x.stride(0), w13, w13.stride(0), w13.stride(1), h, h.stride(0), pair_of_slot, tile_expert, used,
        n_pairs, n_up, d, k, SILU_GLU=False, GLU_OUT=fuse_glu, EVEN=n_up % bn == 0 and d % bk == 0,
        BN=bn, BK=bk, num_warps=warps, num_stages=stages, **flags,
    )
    if fuse_glu:
        a, glu_on_load = h, False
    elif silu:
        a, glu_on_load = h, True
    else:
        a, glu_on_load = act(h[:, :inter], h[:, inter:]).contiguous(), False
    # each pair's output rounded to x's dtype, then weighted and summed in fp32: the reference's rounding
    # (its per-expert GEMMs return x's dtype), and half the bytes of fp32 rows at 8K tokens (600 MB/layer)
    out = torch.empty(n_pairs, d, dtype=x.dtype, device=x.device)
    bn, bk, warps, stages = down
    _grouped_kernel[(tiles, triton.cdiv(d, bn))](
        a, a.stride(0), w2, w2.stride(0), w2.stride(1), out, out.stride(0), pair_of_slot, tile_expert, used,
        n_pairs, d, inter, 1, SILU_GLU=glu_on_load, GLU_OUT=False, EVEN=d % bn == 0 and inter % bk == 0,
        BN=bn, BK=bk, num_warps=warps, num_stages=stages, **flags,
    )
    return sum_pairs(out, k, x.dtype, wts)
