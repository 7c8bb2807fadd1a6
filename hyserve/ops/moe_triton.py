"""Routed experts as Triton grouped GEMMs, for GPUs or dtypes without `torch._grouped_mm` (which
needs bf16 on sm90+): the "otherwise a Triton kernel" of DESIGN.md §6. Same contract as
`moe.experts_forward`.

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


@triton.jit
def _grouped_kernel(
    a_ptr, s_am, w_ptr, s_we, s_wr, out_ptr, s_om, pair_ptr, tile_expert_ptr, used_ptr, wts_ptr,
    n_pairs, N, Kdim, a_div,
    SILU_GLU: tl.constexpr, SCALE: tl.constexpr, IEEE: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):
    """out[p, n] = Σ_c a[p // a_div, c] · w[e, n, c] (× wts[p] with SCALE) for the BM pairs p of this
    tile, e its expert. With SILU_GLU, a row holds gate|up (2·Kdim values) and the SiLU-GLU is applied
    to it first, rounded to a's dtype as the torch GLU rounds it."""
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
    acc = tl.zeros([BM, BN], tl.float32)
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
        w = tl.load(wrows + c[:, None], mask=cm[:, None] & nmask[None, :], other=0.0)
        if IEEE:  # fp32 weights (the CPU-parity presets) need exact products, not tf32
            acc += tl.dot(a, w, input_precision="ieee")
        else:
            acc += tl.dot(a, w)
    if SCALE:
        acc = acc * tl.load(wts_ptr + pairs, mask=valid, other=0.0)[:, None]
    out = out_ptr + tl.where(valid, pairs, 0).to(tl.int64)[:, None] * s_om + cols_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & nmask[None, :])


def expert_tiles(ids: torch.Tensor, num_experts: int, bm: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pair ids in expert order, each expert's run padded to whole BM tiles, padding = T·k;
    the expert of each tile; the number of padded slots in use, on the device)."""
    flat = ids.reshape(-1)
    n, dev = flat.numel(), flat.device
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + bm - 1) // bm * bm
    padded_end = torch.cumsum(padded, 0)
    start = torch.cumsum(counts, 0) - counts
    sorted_e = flat[order]
    rank = torch.arange(n, device=dev) - start[sorted_e]  # position within its expert's run
    slots = n + num_experts * (bm - 1)  # worst case: every expert's last tile partial
    slots = (slots + bm - 1) // bm * bm
    pair_of_slot = torch.full((slots,), n, dtype=torch.long, device=dev)
    pair_of_slot[padded_end[sorted_e] - padded[sorted_e] + rank] = order
    tile_start = torch.arange(0, slots, bm, device=dev)
    tile_expert = torch.searchsorted(padded_end, tile_start, right=True).clamp_(max=num_experts - 1)
    return pair_of_slot, tile_expert, padded_end[-1:]


def experts_forward_triton(
    x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
    act: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], block_m: int = 16, block_n: int = 64,
    block_k: int = 64, num_warps: int = 4,
) -> torch.Tensor:
    """y[t] = Σ_j weights[t, j] · w2_e(act(w1_e x, w3_e x)), e = ids[t, j]; fp32 sum, x's dtype out."""
    t, k = ids.shape
    e, inter, d = w13.shape[0], w13.shape[1] // 2, w13.shape[2]
    assert x.stride(-1) == 1 and w13.stride(-1) == 1 and w2.stride(-1) == 1
    if t == 0:
        return x.new_zeros(0, d)
    pair_of_slot, tile_expert, used = expert_tiles(ids, e, block_m)
    n_pairs, tiles = t * k, pair_of_slot.numel() // block_m
    wts = weights.reshape(-1).float().contiguous()
    ieee = x.dtype == torch.float32
    meta = dict(IEEE=ieee, BM=block_m, BN=block_n, BK=block_k, num_warps=num_warps)
    h = torch.empty(n_pairs, 2 * inter, dtype=x.dtype, device=x.device)
    _grouped_kernel[(tiles, triton.cdiv(2 * inter, block_n))](
        x, x.stride(0), w13, w13.stride(0), w13.stride(1), h, h.stride(0), pair_of_slot, tile_expert, used, wts,
        n_pairs, 2 * inter, d, k, SILU_GLU=False, SCALE=False, **meta,
    )
    silu = getattr(act, "kind", None) == "silu"
    a = h if silu else act(h[:, :inter], h[:, inter:]).contiguous()
    out = torch.empty(n_pairs, d, dtype=torch.float32, device=x.device)
    _grouped_kernel[(tiles, triton.cdiv(d, block_n))](
        a, a.stride(0), w2, w2.stride(0), w2.stride(1), out, out.stride(0), pair_of_slot, tile_expert, used, wts,
        n_pairs, d, inter, 1, SILU_GLU=silu, SCALE=True, **meta,
    )
    return out.view(t, k, d).sum(1).to(x.dtype)
