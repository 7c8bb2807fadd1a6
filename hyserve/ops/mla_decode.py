"""Paged MLA decode in the absorbed form as Triton kernels (docs/ARCHITECTURE.md §7; math:
§4.3).

With q_full = [W_UKᵀ q_n | q_r] (576 values) every head attends to the same cache rows, so one program
handles a block of heads of one sequence and reads each packed page row once: the score is q_full·row
and the value is row[:512]. Long contexts are split over programs (split-K); a second small kernel
combines the partial outputs by log-sum-exp. The up-projections around it stay batched GEMMs in torch.

Why the split kernel looks as it does (48B shape: 32 heads, rows of 512 + 64 bf16 values, pages of 64
rows). A row costs 32 x (576 + 512) x 2 = 70 KFLOP for 1152 bytes, so at HBM speed (4.2 TB/s) the
products need ~250 TFLOP/s: tensor cores, with little shared-memory traffic per row.
- layout "rows": scoresᵀ [BN rows, heads] = K [BN, 576] @ qᵀ and accᵀ [512, heads] +=
  Kᵀ [512, BN] @ Pᵀ [BN, heads]. Rows and latent columns are the M side (64 and 512), so at BN = 64 and
  4 warps (one warpgroup) both are Hopper wgmma, which reads the tile and qᵀ from shared memory once
  per warpgroup. Layout "heads" (the earlier form, the default) has M = 32 heads, under wgmma's 64:
  mma.sync, whose warps each re-read q from shared memory for every tile. Measured on the H200 (sweep
  of 16 configs, 2026-11-30), heads at 64-row tiles, 8 warps and 3 stages with the L2 prefetch beat
  the best rows config by 1.1-1.2x at batch 1 and 8 x 32K and 64 x 8K: it overlaps its copies with
  its products, which the rows form at 64-row tiles cannot (next point).
- Tiles are whole pages or aligned parts of one (BN <= block_size): one block id per tile, affine
  addresses. A split's block ids are read into registers once, so no load stands between two tile
  loads and Triton's pipeliner makes the tile loads cp.async copies. Rows are dense, so the row stride
  is a compile-time constant and the copies need few address registers.
- Triton issues the next tile's copy after the current tile's products, and for a tile that wgmma reads
  in place it keeps one buffer more than num_stages - 1 (BN = 64 at num_stages 3 would need 256 KB of
  shared memory). At BN = 64 (num_stages 2) a program's copies therefore do not overlap its products;
  `prefetch` > 0 has one thread ask the copy engine to pull the tile `prefetch` tiles ahead into L2
  (cp.async.bulk.prefetch), so HBM keeps streaming and the copies hit L2. BN = 32 with num_stages 3-4
  overlaps inside the program instead, with mma.sync for the scores.
- The heads layout is bound by shared-memory reads, not HBM (compiled for sm_90a): at 64-row tiles and
  8 warps each warp re-reads all of q per tile (mma.sync, warps [1, 8]): ~456 KB of ldmatrix reads per
  73.7 KB tile. 4 warps read ~296 KB. "heads64" (heads padded to 64: wgmma) does not help as Triton
  compiles it: for a chained dot it puts all warps on M, so both warpgroups compute the whole score and
  read q once per N block (~500 KB). bf16 partials (`partial_dtype`) halve the split partials' bytes.
  Measured on the H200 (cold L2, split + combine): 4 warps 115.2 µs at batch 8 x 32K (63% of copy) against
  125.0 at 8 warps, 211.3 against 232.6 µs at 64 x 8K, 31.4 against 31.9 at batch 1 x 32K: the default.
  heads64 was 1.3-1.8x slower; bf16 partials 1.0x at batch 1 and slower at 8 and 64.
- Splits: about one program per SM (a 64-row "rows" program takes ~190 KB of shared memory), the fewest
  that fill the machine (`plan_splits`), at most MAX_TILES tiles each. Partials stay fp32
  ([N, S, H, 512]); a split that saw no row writes only its -inf log-sum-exp and the combine reads no
  partial for it. `pdl` launches the combine kernel as a programmatic dependent of the split kernel.
- On Hopper the default takes the Gluon split kernel of `mla_decode_wgmma` for splits of 8 tiles or
  more: rows as M of both products, one warpgroup, and the next tile's copies issued before the
  current tile's products, which Triton's pipeliner would not do (batch 8 x 32K: 100.0 µs, 72% of
  copy; 64 x 8K: 167.8 µs, 86%). Its partials have this kernel's format and the same combine.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from hyserve.ops.kernel_plan import MLA_WGMMA_MIN_TILES
from hyserve.ops.mla_attention import paged_rows
from hyserve.ops.mla_fresh import fresh_attention, pads_fresh
from hyserve.ops.ptx import prefetch_l2


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    # fp32 caches (the tiny CPU-parity presets) need exact fp32 products, not tf32
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _softmax_tile(qc, qr, kc, kr, valid, m, l_sum, acc, qk_scale, DR: tl.constexpr, IEEE: tl.constexpr):
    """One online-softmax step of a block of heads over a tile of cache rows (kc: the R latent columns,
    also the value; kr: the d_r rope columns); rows not `valid` get no weight. Returns (m, l_sum, acc)."""
    sc = _dot(qc, tl.trans(kc), IEEE)
    if DR >= 16:
        sc += _dot(qr, tl.trans(kr), IEEE)
    else:  # tl.dot needs an inner size of at least 16
        sc += tl.sum(qr[:, None, :].to(tl.float32) * kr[None, :, :].to(tl.float32), axis=2)
    sc = tl.where(valid[None, :], sc * qk_scale, float("-inf"))  # log2 units
    m_new = tl.maximum(m, tl.max(sc, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a tile with no valid row: no NaN
    alpha = tl.exp2(m - m_safe)
    p = tl.exp2(sc - m_safe[:, None])
    l_sum = l_sum * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + _dot(p.to(kc.dtype), kc, IEEE)
    return m_new, l_sum, acc


@triton.jit
def _store_split(o_ptr, s_oh, lse_ptr, heads, hmask, dr, m, l_sum, acc):
    """A split's normalised partial output and its log2-sum-exp (-inf when it saw no row)."""
    has = l_sum > 0
    out = acc / tl.where(has, l_sum, 1.0)[:, None]
    lse = tl.where(has, m + tl.log2(tl.where(has, l_sum, 1.0)), float("-inf"))
    tl.store(o_ptr + heads[:, None] * s_oh + dr[None, :], out, mask=hmask[:, None])
    tl.store(lse_ptr + heads, lse, mask=hmask)


MAX_TILES = 64  # tiles one split program walks at most: the plan makes enough splits for that


@triton.jit
def _softmax_tile_rows(qc, qr, kc, kr, valid, m, l_sum, acc, qk_scale, DR: tl.constexpr, IEEE: tl.constexpr):
    """`_softmax_tile` with rows as the M side: qc = qᵀ [R, BH], qr [DR, BH], acc = accᵀ [R, BH]. Every
    tile holds at least one valid row (tiles start inside the context), so the new max is finite."""
    sc = _dot(kc, qc, IEEE)  # [BN, BH]
    if DR >= 16:
        sc += _dot(kr, qr, IEEE)
    else:  # tl.dot needs an inner size of at least 16. Reduced over the last axis: the compiler turns a
        # middle-axis product-sum into a dot, which for fp32 would run at tf32 precision
        sc += tl.sum(kr[:, None, :].to(tl.float32) * tl.trans(qr)[None, :, :].to(tl.float32), axis=2)
    sc = tl.where(valid[:, None], sc * qk_scale, float("-inf"))  # log2 units
    m_new = tl.maximum(m, tl.max(sc, axis=0))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(sc - m_new[None, :])
    l_sum = l_sum * alpha + tl.sum(p, axis=0)
    acc = acc * alpha[None, :] + _dot(tl.trans(kc), p.to(kc.dtype), IEEE)
    return m_new, l_sum, acc


@triton.jit
def _tile_base(pages_ptr, s_pb, ids, ti, t, t0, BS: tl.constexpr, BN: tl.constexpr, W: tl.constexpr):
    """First row of tile t when BN <= BS (the tile is an aligned part of one page): its block id comes
    from the split's ids held in registers, so no load stands between two tile loads."""
    blk = tl.sum(tl.where(ti == t - t0, ids, 0)).to(tl.int64)
    return pages_ptr + blk * s_pb + (t % (BS // BN)) * (BN * W)


@triton.jit
def _tile_rows(pages_ptr, s_pb, bt_row, ids, ti, t, t0, end, BS: tl.constexpr, BN: tl.constexpr,
               W: tl.constexpr):
    """Pointers to the BN rows of tile t ([BN]) and which of them hold context. BN > BS (small pages):
    each row looks its page up in the block table."""
    rows = tl.arange(0, BN)
    pos = t * BN + rows
    if BN <= BS:
        ptrs = _tile_base(pages_ptr, s_pb, ids, ti, t, t0, BS, BN, W) + rows * W
    else:
        blk = tl.load(bt_row + pos // BS, mask=pos < end, other=0).to(tl.int64)
        ptrs = pages_ptr + blk * s_pb + (pos % BS) * W
    return ptrs, pos < end


@triton.jit(do_not_specialize=["S"])  # one compiled kernel whatever the split count
def _mla_split_kernel(
    q_ptr, s_qn, s_qh, qr_ptr, s_rn, s_rh, pages_ptr, s_pb, bt_ptr, s_btn, ctx_ptr,
    o_ptr, s_on, s_os, s_oh, lse_ptr, s_ln, s_ls,
    H, qk_scale, S,
    BS: tl.constexpr, R: tl.constexpr, DR: tl.constexpr, BH: tl.constexpr, BN: tl.constexpr,
    ROWS_MAJOR: tl.constexpr, PREFETCH: tl.constexpr, MAXT: tl.constexpr, PDL: tl.constexpr,
    IEEE: tl.constexpr,
):
    """Program (n, split, head block): the split's tiles of sequence n, online softmax, one partial. The
    query's R latent values are read at q_ptr, its d_r rope values at qr_ptr (its own strides)."""
    n = tl.program_id(0)
    sp = tl.program_id(1)
    hb = tl.program_id(2)
    if PDL:  # the combine kernel may be scheduled now; it waits for this grid before reading
        tl.extra.cuda.gdc_launch_dependents()
    W: tl.constexpr = R + DR  # dense rows: the row stride
    ctx = tl.load(ctx_ptr + n).to(tl.int32)
    # each sequence's own context over the S splits (whole tiles): with S planned for a longer context
    # (a CUDA graph plans for max_model_len) a short one still spreads over programs, not into split 0
    chunk = tl.cdiv(tl.cdiv(ctx, S), BN) * BN
    start = sp * chunk
    end = tl.minimum(start + chunk, ctx)
    t0 = start // BN
    t1 = tl.minimum(tl.cdiv(end, BN), t0 + MAXT)  # the plan keeps splits within MAXT tiles
    heads = hb * BH + tl.arange(0, BH)
    hmask = heads < H
    dr = tl.arange(0, R)
    dq = tl.arange(0, DR)
    bt_row = bt_ptr + n * s_btn
    ti = tl.arange(0, MAXT)
    if BN <= BS:  # this split's block ids, once
        ids = tl.load(bt_row + (t0 + ti) // (BS // BN), mask=t0 + ti < t1, other=0).to(tl.int32)
    else:
        ids = ti
    # PREFETCH (BN <= BS only): the tile PREFETCH ahead of the one being read goes to L2 now
    tile_bytes = tl.full((), BN * W * (pages_ptr.dtype.element_ty.primitive_bitwidth // 8), tl.int32)
    if PREFETCH > 0:
        for j in tl.static_range(PREFETCH):
            if t0 + j < t1:
                prefetch_l2(_tile_base(pages_ptr, s_pb, ids, ti, t0 + j, t0, BS, BN, W), tile_bytes)
    qrow = q_ptr + n * s_qn + heads * s_qh
    rrow = qr_ptr + n * s_rn + heads * s_rh
    m = tl.full([BH], float("-inf"), tl.float32)
    l_sum = tl.zeros([BH], tl.float32)
    if ROWS_MAJOR:
        qc = tl.load(qrow[None, :] + dr[:, None], mask=hmask[None, :], other=0.0)  # qᵀ: [R, BH]
        qr = tl.load(rrow[None, :] + dq[:, None], mask=hmask[None, :], other=0.0)  # [DR, BH]
        acc = tl.zeros([R, BH], tl.float32)
    else:
        qc = tl.load(qrow[:, None] + dr[None, :], mask=hmask[:, None], other=0.0)  # [BH, R]
        qr = tl.load(rrow[:, None] + dq[None, :], mask=hmask[:, None], other=0.0)
        acc = tl.zeros([BH, R], tl.float32)
    for t in range(t0, t1):
        if PREFETCH > 0:
            if t + PREFETCH < t1:
                prefetch_l2(_tile_base(pages_ptr, s_pb, ids, ti, t + PREFETCH, t0, BS, BN, W), tile_bytes)
        ptrs, valid = _tile_rows(pages_ptr, s_pb, bt_row, ids, ti, t, t0, end, BS, BN, W)
        kc = tl.load(ptrs[:, None] + dr[None, :], mask=valid[:, None], other=0.0)  # [BN, R], also the value
        kr = tl.load(ptrs[:, None] + R + dq[None, :], mask=valid[:, None], other=0.0)  # [BN, DR]
        if ROWS_MAJOR:
            m, l_sum, acc = _softmax_tile_rows(qc, qr, kc, kr, valid, m, l_sum, acc, qk_scale, DR, IEEE)
        else:
            m, l_sum, acc = _softmax_tile(qc, qr, kc, kr, valid, m, l_sum, acc, qk_scale, DR, IEEE)
    # a split that saw no row writes only lse = -inf and the combine reads no partial for it; split 0
    # writes zeros then (an empty context: the single-split result is that partial)
    has = l_sum > 0
    keep = has | (heads * 0 + sp == 0)  # (a tensor: the interpreter rejects a scalar-or mask)
    lse = tl.where(has, m + tl.log2(tl.where(has, l_sum, 1.0)), float("-inf"))
    tl.store(lse_ptr + n * s_ln + sp * s_ls + heads, lse, mask=hmask)
    o_base = o_ptr + n * s_on + sp * s_os
    if ROWS_MAJOR:
        out = acc / tl.where(has, l_sum, 1.0)[None, :]
        tl.store(o_base + heads[None, :] * s_oh + dr[:, None], out.to(o_ptr.dtype.element_ty),
                 mask=(hmask & keep)[None, :])
    else:
        out = acc / tl.where(has, l_sum, 1.0)[:, None]
        tl.store(o_base + heads[:, None] * s_oh + dr[None, :], out.to(o_ptr.dtype.element_ty),
                 mask=(hmask & keep)[:, None])


@triton.jit(do_not_specialize=["S"])
def _mla_combine_kernel(
    o_ptr, s_on, s_os, s_oh, lse_ptr, s_ln, s_ls, out_ptr, s_outn, s_outh, S,
    BR: tl.constexpr, SC: tl.constexpr, PDL: tl.constexpr,
):
    """Program (n, h, rb): BR latent columns of head h over all splits, SC splits at a time (online
    log-sum-exp). A split whose lse is -inf has no partial output and is not read."""
    n = tl.program_id(0)
    h = tl.program_id(1)
    rb = tl.program_id(2)
    if PDL:  # launched early (programmatic dependent launch): wait for the split kernel's stores
        tl.extra.cuda.gdc_wait()
    dr = rb * BR + tl.arange(0, BR)
    m = tl.full([1], float("-inf"), tl.float32)
    den = tl.zeros([1], tl.float32)
    acc = tl.zeros([BR], tl.float32)
    for s0 in range(0, S, SC):
        s = s0 + tl.arange(0, SC)
        lse = tl.load(lse_ptr + n * s_ln + s * s_ls + h, mask=s < S, other=float("-inf"))
        part = tl.load(o_ptr + n * s_on + s[:, None] * s_os + h * s_oh + dr[None, :],
                       mask=(lse > float("-inf"))[:, None], other=0.0).to(tl.float32)
        m_new = tl.maximum(m, tl.max(lse, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_safe)  # 0 while nothing was seen
        wts = tl.exp2(lse[:, None] - m_safe[None, :])  # [SC, 1]; 0 for empty splits
        den = den * alpha + tl.sum(wts, axis=0)
        acc = acc * alpha + tl.sum(part * wts, axis=0)
        m = m_new
    acc = acc / tl.where(den > 0, den, 1.0)
    tl.store(out_ptr + n * s_outn + h * s_outh + dr, acc.to(out_ptr.dtype.element_ty))


LAYOUTS = ("auto", "rows", "heads", "heads64", "wgmma")


def _wgmma_unsupported(q_full: torch.Tensor, pages: torch.Tensor, block_n: int, r: int, dr: int) -> str | None:
    """Why the Gluon kernel (mla_decode_wgmma) cannot run this call; None when it can."""
    if not q_full.is_cuda:
        return "needs a Hopper GPU (wgmma)"
    try:
        from hyserve.ops import mla_decode_wgmma
    except ImportError as e:  # Triton without Gluon
        return f"needs Triton's Gluon ({e})"
    return mla_decode_wgmma.unsupported(q_full, pages, block_n, r, dr)


def plan_splits(n: int, hblocks: int, max_context: int, block_n: int, sms: int) -> int:
    """Splits per sequence for `n` sequences of up to `max_context` rows: the fewest programs that fill
    `sms` multiprocessors (one split program per SM fits in shared memory), by a small cost model in
    tile units: waves x (tiles per split + 2 for a program's fixed cost: first-load latency, q, the
    64 KB partial store) + the combine's reads (about one tile per program, spread over the machine).
    Each split walks at most MAX_TILES tiles."""
    tiles = max(1, triton.cdiv(max_context, block_n))
    lo = triton.cdiv(tiles, MAX_TILES)
    best = None
    for s in range(lo, max(lo, min(tiles, 4 * sms)) + 1):
        progs = n * hblocks * s
        cost = triton.cdiv(progs, sms) * (triton.cdiv(tiles, s) + 2) + progs / sms
        if best is None or cost < best[0] - 1e-9:
            best = (cost, s)
    return best[1]


def mla_decode_latent(
    q_full: torch.Tensor, pages: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
    max_context: int, scale: float, kv_lora_rank: int, num_splits: int | None = None, block_n: int = 64,
    num_warps: int = 4, num_stages: int = 3, layout: str = "auto", prefetch: int | None = None, pdl: bool = False,
    partial_dtype: torch.dtype = torch.float32, q_rope: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Attention of q_full [N, H, R + d_r] over each sequence's cached rows; returns o_lat [N, H, R] fp32.
    With q_rope [N, H, d_r], q_full holds only the R latent values (two views read in place: no
    concatenation kernel); both in pages' dtype, last dims unit-stride. out_dtype: o_lat's (the fp32 result
    rounded once by the combine kernel).

    pages is one layer's view [blocks, block_size, row] (rows dense: stride(1) == row width);
    block_tables [N, B]; context_lens [N] on the device; max_context bounds them on the host (a CUDA
    graph passes max_model_len) and sets the number of splits, over which each sequence spreads its own
    context. Knobs (benchmarks/gpu_kernels.py --only mla sweeps them on cold-L2 graph replays):
    layout "auto" (the default): "wgmma" where it runs and each split walks at least MLA_WGMMA_MIN_TILES
    tiles (ops/kernel_plan.py, with its measurements), else "heads"; "wgmma" = the Gluon kernel of `mla_decode_wgmma` (rows as M of both products,
    one warpgroup, its own double buffering; Hopper, bf16/fp16 rows, block_n 64; num_warps and
    num_stages do not apply to it); "heads" = heads as M (mma.sync); "rows" = rows as M in Triton;
    "heads64" = heads padded to a block of 64 with zero queries. block_n = rows per tile (a power of two
    >= 16; 64 is the most a "rows" program fits in shared memory at 2 stages), num_warps, num_stages
    (Triton layouts: heads bn64 w4 s3 is their best on an H200); prefetch = tiles pulled into L2 ahead
    (CUDA only; 0 = off; None = 0 for "wgmma", where it measured slower, and 2 for the others); pdl =
    launch the combine kernel early (CUDA only); num_splits = None to plan (`plan_splits`);
    partial_dtype = the split partials' dtype (fp32, or bf16 to halve their bytes; products, softmax and
    the combine's sums stay fp32).
    """
    n, h, _ = q_full.shape
    r = kv_lora_rank
    if q_rope is None:
        q_rope = q_full[..., r:]
    dr, width = q_rope.shape[-1], r + q_rope.shape[-1]
    assert q_full.shape[-1] in (r, width) and q_rope.shape[:2] == (n, h) and q_rope.dtype == q_full.dtype
    assert q_full.stride(-1) == 1 and q_rope.stride(-1) == 1 and pages.stride(-1) == 1 and pages.shape[-1] == width
    assert pages.stride(-2) == width, "rows of a page must be dense"
    assert layout in LAYOUTS, layout
    if pages.element_size() == 1:  # FP8 rows: wgmma reads 8-bit operands K-major only (Kᵀ is not), and
        # heads-major at 64 rows spills: the earlier kernel's config (no spill at 32 rows and 8 warps)
        layout, block_n, num_warps = "heads", min(block_n, 32), max(num_warps, 8)
    if pages.element_size() == 4:  # fp32 rows (tiny parity presets) use FMA dots: half the tile, and two
        # stages of it (three of 32 fp32 rows would fill shared memory)
        block_n, num_stages = min(block_n, 32), min(num_stages, 2)
    bh = max(16, min(32, triton.next_power_of_2(h)))  # tl.dot needs >= 16 rows
    if layout == "heads64":  # wgmma's M: the heads past h are masked (zero queries, no store)
        layout, bh = "heads", 64
    hblocks = triton.cdiv(h, bh)
    on_gpu = q_full.is_cuda
    if num_splits is None:
        sms = torch.cuda.get_device_properties(q_full.device).multi_processor_count if on_gpu else 132
        num_splits = plan_splits(n, hblocks, max_context, block_n, sms)
    tiles = triton.cdiv(max(max_context, 1), block_n)
    # no split without a tile, none longer than MAX_TILES tiles
    num_splits = max(triton.cdiv(tiles, MAX_TILES), min(num_splits, tiles))
    if layout in ("auto", "wgmma"):
        why = _wgmma_unsupported(q_full, pages, block_n, r, dr)
        if layout == "wgmma" and why:
            raise ValueError(f"layout 'wgmma': {why}")
        long_splits = triton.cdiv(tiles, num_splits) >= MLA_WGMMA_MIN_TILES
        layout = "wgmma" if why is None and long_splits else "heads"
    if prefetch is None:
        prefetch = 0 if layout == "wgmma" else 2
    assert partial_dtype in (torch.float32, torch.bfloat16), partial_dtype
    part = torch.empty(n, num_splits, h, r, dtype=partial_dtype, device=q_full.device)
    lse = torch.empty(n, num_splits, h, dtype=torch.float32, device=q_full.device)
    # the L2 prefetch and PDL are inline PTX: compiled kernels only (the CPU interpreter runs without them)
    aligned = pages.data_ptr() % 16 == 0 and pages.stride(0) * pages.element_size() % 16 == 0
    prefetch = prefetch if on_gpu and aligned and block_n <= pages.shape[1] else 0
    pdl = pdl and on_gpu
    if layout == "wgmma":
        from hyserve.ops import mla_decode_wgmma

        mla_decode_wgmma.launch_split(q_full, q_rope, pages, block_tables, context_lens, part, lse,
                                      scale * math.log2(math.e), prefetch, MAX_TILES, bh)
        return combine_splits(part, lse, pdl=pdl, out_dtype=out_dtype)
    _mla_split_kernel[(n, num_splits, hblocks)](
        q_full, q_full.stride(0), q_full.stride(1), q_rope, q_rope.stride(0), q_rope.stride(1), pages, pages.stride(0),
        block_tables, block_tables.stride(0), context_lens,
        part, *part.stride()[:3], lse, *lse.stride()[:2],
        h, scale * math.log2(math.e), num_splits,
        BS=pages.shape[1], R=r, DR=dr, BH=bh, BN=block_n, ROWS_MAJOR=layout == "rows", PREFETCH=prefetch,
        MAXT=MAX_TILES, PDL=pdl, IEEE=pages.dtype == torch.float32,
        num_warps=num_warps, num_stages=num_stages,
    )
    return combine_splits(part, lse, pdl=pdl, out_dtype=out_dtype)


def combine_splits(part: torch.Tensor, lse: torch.Tensor, pdl: bool = False,
                   out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Merge split-K partial outputs part [N, S, H, R] (fp32 or bf16) by their log2-sum-exp lse [N, S, H]:
    [N, H, R] in out_dtype (the fp32 result rounded once: for the model-dtype GEMM after it, no cast kernel).
    A split with lse = -inf contributes nothing and its partial is not read. pdl (CUDA): launch as a
    programmatic dependent of the kernel before it on the stream, which may then still be running; the
    combine waits for that kernel's writes before it reads."""
    n, num_splits, h, r = part.shape
    if num_splits == 1:
        return part[:, 0].to(out_dtype)  # (a view when no cast)
    out = torch.empty(n, h, r, dtype=out_dtype, device=part.device)
    # all splits in one chunk up to 256 (its loads are not pipelined: one chunk = one round trip), and
    # at most 4096 partial values per program (32 registers a thread)
    sc = min(256, triton.next_power_of_2(num_splits))
    br = min(r, max(16, 4096 // sc))
    extra = {"launch_pdl": True} if pdl else {}
    _mla_combine_kernel[(n, h, triton.cdiv(r, br))](
        part, *part.stride()[:3], lse, *lse.stride()[:2], out, out.stride(0), out.stride(1), num_splits,
        BR=br, SC=sc, PDL=pdl, num_warps=4, **extra,
    )
    return out


def mla_absorbed_decode_fast(
    q_nope: torch.Tensor, q_rope: torch.Tensor, pages: torch.Tensor, layer: int, block_tables: torch.Tensor,
    context_lens: torch.Tensor, max_context: int, kv_b: torch.Tensor, kv_lora_rank: int, v_head_dim: int,
    scale: float, layout: str = "auto",
) -> torch.Tensor:
    """Same contract as `mla_attention.mla_absorbed_decode` (plus max_context); returns o [N, H, d_v] in
    the model dtype. q_lat = W_UKᵀ q_n and o = W_UV o_lat are batched GEMMs over heads. `layout`: the split
    kernel's (`mla_decode_latent`; the kernel plan passes "heads" where the Gluon kernel cannot run)."""
    n, h, dn = q_nope.shape
    w = kv_b.view(h, dn + v_head_dim, kv_lora_rank)
    q_lat = torch.bmm(q_nope.transpose(0, 1), w[:, :dn])  # [H, N, R]
    if q_lat.dtype == q_rope.dtype == pages.dtype and q_rope.stride(-1) == 1:  # the kernel reads both in place
        o_lat = mla_decode_latent(q_lat.transpose(0, 1), pages[:, layer], block_tables, context_lens, max_context,
                                  scale, kv_lora_rank, layout=layout, q_rope=q_rope, out_dtype=kv_b.dtype)
    else:  # a cast to the cache's dtype (FP8 rows) as one row
        q_full = torch.cat([q_lat.transpose(0, 1), q_rope.to(q_lat.dtype)], -1).to(pages.dtype)
        o_lat = mla_decode_latent(q_full, pages[:, layer], block_tables, context_lens, max_context, scale,
                                  kv_lora_rank, layout=layout, out_dtype=kv_b.dtype)
    o = torch.bmm(o_lat.transpose(0, 1), w[:, dn:].transpose(1, 2))  # [H, N, d_v]
    return o.transpose(0, 1)


# attend(q, k, v, causal, scale) -> (o, lse): attention of q [1, H, L, d] over k [1, H, S, d] and
# v [1, H, S, d_v], with each query's natural log-sum-exp [1, H, L] (fp32); causal = SDPA's top-left is_causal
AttendLse = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool, float], tuple[torch.Tensor, torch.Tensor]]


def merge_attention(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """Attention over the union of two disjoint key sets from each set's normalised output o [..., L, d]
    and natural log-sum-exp lse [..., L]: exactly the softmax over all keys, computed in fp32 and cast to
    `out`'s dtype (written in place, any strides) or o_a's. A's weight exp(lse_a - m) / (exp(lse_a - m) +
    exp(lse_b - m)), m = max(lse_a, lse_b), is sigmoid(lse_a - lse_b): no overflow, and a part without keys
    (lse = -inf) weighs 0."""
    w_a = torch.sigmoid(lse_a.float() - lse_b.float()).unsqueeze(-1)
    merged = torch.lerp(o_b.float(), o_a.float(), w_a)
    if out is None:
        return merged.to(o_a.dtype)
    return out.copy_(merged)


@triton.jit
def _merge_kernel(oa_ptr, s_oab, s_oah, s_oal, ob_ptr, s_obb, s_obh, s_obl, la_ptr, s_lab, s_lah, s_lal,
                  lb_ptr, s_lbb, s_lbh, s_lbl, out_ptr, s_outb, s_outh, s_outl, L,
                  D: tl.constexpr, BL: tl.constexpr, BD: tl.constexpr):
    """Program (query block, head, batch): `merge_attention` of BL queries, all D values, in one pass."""
    pl, h, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = pl * BL + tl.arange(0, BL)
    cols = tl.arange(0, BD)
    rmask = rows < L
    mask = rmask[:, None] & (cols < D)[None, :]
    la = tl.load(la_ptr + b * s_lab + h * s_lah + rows * s_lal, mask=rmask, other=0.0)
    lb = tl.load(lb_ptr + b * s_lbb + h * s_lbh + rows * s_lbl, mask=rmask, other=0.0)
    w = tl.sigmoid(la - lb)[:, None]
    oa = tl.load(oa_ptr + b * s_oab + h * s_oah + rows[:, None] * s_oal + cols[None, :], mask=mask, other=0.0)
    ob = tl.load(ob_ptr + b * s_obb + h * s_obh + rows[:, None] * s_obl + cols[None, :], mask=mask, other=0.0)
    ob = ob.to(tl.float32)
    o = ob + w * (oa.to(tl.float32) - ob)
    tl.store(out_ptr + b * s_outb + h * s_outh + rows[:, None] * s_outl + cols[None, :],
             o.to(out_ptr.dtype.element_ty), mask=mask)


def merge_attention_triton(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor,
                           out: torch.Tensor | None = None) -> torch.Tensor:
    """`merge_attention` of o [B, H, L, D] (last dim unit-stride) as one Triton kernel: the torch form
    makes four passes over fp32 copies of the outputs, this one reads each output once and writes once."""
    assert o_a.dim() == 4 and o_a.shape == o_b.shape and o_a.stride(-1) == o_b.stride(-1) == 1
    bsz, h, n, d = o_a.shape
    out = torch.empty_like(o_a) if out is None else out
    assert out.shape == o_a.shape and out.stride(-1) == 1
    bl, bd = 32, triton.next_power_of_2(d)
    _merge_kernel[(triton.cdiv(n, bl), h, bsz)](
        o_a, *o_a.stride()[:3], o_b, *o_b.stride()[:3], lse_a, *lse_a.stride(), lse_b, *lse_b.stride(),
        out, *out.stride()[:3], n, D=d, BL=bl, BD=bd, num_warps=4,
    )
    return out


def attention_split(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, attend: AttendLse,
                    d_v: int, out: torch.Tensor | None = None,
                    merge: Callable[..., torch.Tensor] | None = None) -> torch.Tensor:
    """The lower-right causal attention of a chunk of L queries at the end of S keys (q [1, H, L, d], k and
    v [1, H, S, d]) as two calls `attend` serves at full speed, merged by log-sum-exp: the queries over the
    S - L cached keys without a mask, and over the chunk's own L keys with the top-left causal mask. The
    result's first d_v values (v may be padded wider): [1, H, L, d_v] (into `out` when given). `merge`:
    `merge_attention_triton` on CUDA, `merge_attention` elsewhere, unless given."""
    ctx = k.shape[2] - q.shape[2]
    o_a, lse_a = attend(q, k[:, :, :ctx], v[:, :, :ctx], False, scale)
    o_b, lse_b = attend(q, k[:, :, ctx:], v[:, :, ctx:], True, scale)
    merge = merge or (merge_attention_triton if q.is_cuda else merge_attention)
    return merge(o_a[..., :d_v], lse_a, o_b[..., :d_v], lse_b, out)


def cudnn_attention_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                        scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`AttendLse` through cuDNN's fused attention, which SDPA picks for plain causal and unmasked calls
    but never for a lower-right bias. Its lse is [B, H, L, 1] in torch 2.13 and was [B, H, L] before:
    reshaped to [B, H, L]."""
    o, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False,
                                                                scale=scale)[:2]
    return o, lse.reshape(o.shape[:-1])


def reference_attention_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                             scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`AttendLse` in plain torch math (fp32 scores; for the CPU and tests), o in q's dtype."""
    from hyserve.ops.mla_attention import attention_with_lse

    o, lse = attention_with_lse(q, k, v, causal, scale)
    return o.to(q.dtype), lse


# A chunk or a cached context under this many rows keeps the one lower-right call: its attention takes
# microseconds either way, and cuDNN then never sees a key length of 1 (which SDPA itself keeps from it)
SPLIT_MIN_ROWS = 64
# By default only chunks of this many queries split. cuDNN builds an execution plan for every new shape
# (about 42 ms a call shape on the H200, 110 ms for a split's two), while the split saves about 1.4 ms a
# layer at 2,049 queries over 12,288 keys and 4.6 ms at 8,192 over 16,384: a plan pays only where shapes
# repeat, as the full-budget chunks of a long prompt do (8,192 over multiples of 8,192), and the few
# hundred to few thousand new tokens of an agentic turn over a context of any length do not
SPLIT_MIN_QUERIES = 4096

# the cuDNN split's v form per class of inputs (device, dtype, heads, q/k and v widths): "narrow" (v at
# d_v), "padded" (v zero-padded to the q/k width) or None (no cuDNN op for this class: the one lower-right
# call). Probed once per class, so the hot path holds no try/except
_CUDNN_SPLIT: dict[tuple, str | None] = {}


def cudnn_split_mode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
    """How the cuDNN split serves q, k [T, H, d] and v [T, H, d_v] laid end to end ("narrow", "padded"),
    or None where it cannot: not CUDA, cuDNN SDPA off or missing in this torch, or the op rejects or
    miscomputes the class (dtype, head dims) on a probe."""
    if not q.is_cuda or not torch.backends.cuda.cudnn_sdp_enabled():
        return None
    key = (q.device, q.dtype, q.shape[1], q.shape[-1], k.shape[-1], v.shape[-1])
    if key not in _CUDNN_SPLIT:
        if torch.cuda.is_current_stream_capturing():  # the probe reads its results back: not now
            return None
        _CUDNN_SPLIT[key] = _probe_cudnn_split(q.device, q.dtype, q.shape[1], q.shape[-1], v.shape[-1])
    return _CUDNN_SPLIT[key]


def split_values(v: torch.Tensor, mode: str, width: int) -> torch.Tensor:
    """v [T, H, d_v] as the cuDNN split reads it: dense ("narrow"), or zero-padded to `width` ("padded").
    Dense keys, queries and values in the [T, H, d] order are what torch's cuDNN attention can serve
    without building plans for every sequence length (TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1)."""
    import torch.nn.functional as F

    return v.contiguous() if mode == "narrow" else F.pad(v, (0, width - v.shape[-1]))


def _probe_cudnn_split(device: torch.device, dtype: torch.dtype, h: int, d: int, d_v: int) -> str | None:
    """The first v form for which the cuDNN op runs and agrees with the math reference, causal and
    unmasked, at lengths a split meets (also ones that are no multiple of a tile). Random inputs laid out
    as `mla_prefill_fast` lays out its own (dense [T, H, d] rows), not the step's, which may hold anything
    (rows of a cache never written)."""
    if not hasattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention"):
        return None
    m = SPLIT_MIN_ROWS
    gen = torch.Generator(device).manual_seed(0)
    q, k = (torch.randn(2, 2 * m, h, d, device=device, generator=gen).to(dtype)).unbind(0)
    v = torch.randn(2 * m, h, d_v, device=device, generator=gen).to(dtype)
    shapes = [(m, m, True), (m, 2 * m - 3, False), (m - 7, m - 7, True)]
    for mode in ("narrow", "padded"):
        vm = split_values(v, mode, d)
        ok = True
        for nq, nk, causal in shapes:
            qs, ks, vs = (z[:n].transpose(0, 1).unsqueeze(0) for z, n in ((q, nq), (k, nk), (vm, nk)))
            try:
                o, lse = cudnn_attention_lse(qs, ks, vs, causal, d**-0.5)
            except (RuntimeError, ValueError, NotImplementedError):
                ok = False
                break
            o_ref, lse_ref = reference_attention_lse(qs, ks, vs, causal, d**-0.5)
            err = (o.float() - o_ref.float()).norm() / o_ref.float().norm().clamp_min(1e-30)
            if o.shape != o_ref.shape or not bool(err < 2e-2) or not torch.allclose(lse, lse_ref, rtol=1e-3,
                                                                                      atol=2e-2):
                ok = False
                break
        if ok:
            return mode
    return None


def split_plan(query_lens: list[int], context_lens: list[int], split: bool | None) -> list[bool]:
    """Which chunks `mla_prefill_fast` would split (see its `split`), before asking whether cuDNN serves them."""
    return [split is not False and nq < nc and (split or (nq >= SPLIT_MIN_QUERIES and nc - nq >= SPLIT_MIN_ROWS))
            for nq, nc in zip(query_lens, context_lens)]


def _prefill_values(q: torch.Tensor, k: torch.Tensor, v_lat: torch.Tensor, splits: list[bool], split: bool | None
                    ) -> tuple[list[bool], AttendLse | None, torch.Tensor | None, torch.Tensor | None]:
    """(the chunks that do split, their attention, v as the split reads it, v padded to the q/k width for
    the one-call sequences): no split where neither cuDNN nor a forced split (the math reference) serves it.
    The narrow split needs no padded copy of v (and does a third fewer P·V products) unless a sequence
    takes the one call."""
    import torch.nn.functional as F

    mode = cudnn_split_mode(q, k, v_lat) if any(splits) else None
    attend: AttendLse | None = None if mode is None else cudnn_attention_lse
    if mode is None and split:
        mode, attend = "narrow", reference_attention_lse
    if attend is None:
        splits = [False] * len(splits)
    v_split = split_values(v_lat, mode, k.shape[-1]) if any(splits) else None
    v_padded = v_split if mode == "padded" else None
    if not all(splits) and v_padded is None:
        v_padded = F.pad(v_lat, (0, k.shape[-1] - v_lat.shape[-1]))
    return splits, attend, v_split, v_padded


def mla_prefill_fast(
    q_nope: torch.Tensor, q_rope: torch.Tensor, pages: torch.Tensor, layer: int, block_tables: torch.Tensor,
    query_lens: list[int], context_lens: list[int], kv_b: torch.Tensor, kv_lora_rank: int, v_head_dim: int,
    scale: float, context_rows: tuple[torch.Tensor, torch.Tensor] | None = None, split: bool | None = None,
    max_rows: int | None = None,
) -> torch.Tensor:
    """Expanded-form attention for prefill sequences laid end to end (q_* [Tq, H, d]).

    The cached rows of all sequences are gathered in one indexing op and up-projected by one GEMM. A
    fresh prompt (query_len == context_len) is one causal SDPA call (cuDNN's flash kernel on the H200), on
    CUDA padded to the length ladder of `mla_fresh` (no request waits for a cuDNN plan); v
    is zero-padded to the q/k width so the flash kernels apply. A long chunk over a cached context is split
    (`attention_split`): its queries over the cached keys unmasked and over its own keys causally, two
    cuDNN calls merged by log-sum-exp, since SDPA serves the lower-right causal bias of one call only
    through FlashAttention-2 at about half cuDNN's rate on the H200; shorter chunks keep that one call
    (see SPLIT_MIN_QUERIES). Returns [Tq, H, d_v].
    `context_rows`: (page, row) of every cached position (`PrefillRows.context_rows`, built once for every
    layer of a step); without it they are derived from block_tables here.
    `split`: None = split the chunks of at least SPLIT_MIN_QUERIES over at least SPLIT_MIN_ROWS cached
    rows where cuDNN serves the inputs (`cudnn_split_mode`); False = one lower-right call per chunk; True = split
    every chunk over a cached context, through the math reference where cuDNN does not serve the inputs
    (the CPU tests).
    `max_rows`: the most cached rows expanded at once (default MAX_EXPANDED_ROWS; see `_prefill_bounded`).
    """
    bs = pages.shape[2]
    page, row = context_rows if context_rows is not None else paged_rows(block_tables, context_lens, bs)
    if page.numel() > (max_rows or MAX_EXPANDED_ROWS):
        return _prefill_bounded(q_nope, q_rope, pages, layer, page, row, query_lens, context_lens, kv_b, kv_lora_rank,
                                v_head_dim, scale, split, max_rows or MAX_EXPANDED_ROWS)
    return _prefill_expanded(q_nope, q_rope, pages, layer, page, row, query_lens, context_lens, kv_b, kv_lora_rank,
                             v_head_dim, scale, split)


def _expand(pages: torch.Tensor, layer: int, page: torch.Tensor, row: torch.Tensor, kv_b: torch.Tensor,
            kv_lora_rank: int, heads: int, v_head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(k [S, H, dn + dr], v [S, H, d_v]) of the cached rows at (page, row): one gather, one up-projection."""
    rows = pages[page, layer, row]  # [S, R + d_r]
    dn = kv_b.shape[0] // heads - v_head_dim
    kv = (rows[:, :kv_lora_rank].to(kv_b.dtype) @ kv_b.t()).view(page.numel(), heads, dn + v_head_dim)
    k = torch.cat([kv[..., :dn], rows[:, None, kv_lora_rank:].to(kv.dtype).expand(-1, heads, -1)], -1)
    return k, kv[..., dn:]


def _prefill_expanded(q_nope: torch.Tensor, q_rope: torch.Tensor, pages: torch.Tensor, layer: int, page: torch.Tensor,
                      row: torch.Tensor, query_lens: list[int], context_lens: list[int], kv_b: torch.Tensor,
                      kv_lora_rank: int, v_head_dim: int, scale: float, split: bool | None) -> torch.Tensor:
    """`mla_prefill_fast` with every sequence's cached rows expanded at once."""
    import torch.nn.functional as F
    from torch.nn.attention.bias import causal_lower_right

    dev = pages.device
    h = q_nope.shape[1]
    k, v_lat = _expand(pages, layer, page, row, kv_b, kv_lora_rank, h, v_head_dim)
    q = torch.cat([q_nope, q_rope], -1).to(k.dtype)
    splits, attend, v_split, v_padded = _prefill_values(q, k, v_lat, split_plan(query_lens, context_lens, split),
                                                        split)
    out = torch.empty(q.shape[0], h, v_head_dim, dtype=k.dtype, device=dev)
    pad_fresh = pads_fresh(q)
    q0 = c0 = 0
    for nq, nc, sp in zip(query_lens, context_lens, splits):
        qi = q[q0 : q0 + nq].transpose(0, 1).unsqueeze(0)
        ki = k[c0 : c0 + nc].transpose(0, 1).unsqueeze(0)
        if sp:
            vi = v_split[c0 : c0 + nc].transpose(0, 1).unsqueeze(0)
            attention_split(qi, ki, vi, scale, attend, v_head_dim, out=out[q0 : q0 + nq].transpose(0, 1).unsqueeze(0))
        elif nq == nc and pad_fresh:  # a fresh prompt: on the length ladder, whose cuDNN plans the warm-up built
            out[q0 : q0 + nq] = fresh_attention(q[q0 : q0 + nq], k[c0 : c0 + nc], v_padded[c0 : c0 + nc],
                                                scale)[..., :v_head_dim]
        else:
            vi = v_padded[c0 : c0 + nc].transpose(0, 1).unsqueeze(0)
            # query j sits at position nc - nq + j: the causal diagonal is aligned to the lower right, which
            # SDPA serves without a mask (a materialized [nq, nc] mask sent a chunk over a long cached
            # context to the slower masked kernels); for nq == nc it is the plain causal call
            oi = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=causal_lower_right(nq, nc), scale=scale)
            out[q0 : q0 + nq] = oi[0, :, :, :v_head_dim].transpose(0, 1)
        q0, c0 = q0 + nq, c0 + nc
    return out


# The expanded form up-projects every cached row a prefill chunk attends to: 40 KB a row at the 48B shape
# (32 heads; keys, values, values padded), so a chunk at the end of a 1M-token prompt would ask for 40 GB at
# once. A step whose prefill sequences hold more cached rows than this expands them in groups of sequences,
# and a sequence longer than this alone attends to its cached rows piece by piece (planning/memory_profile.py
# profiles a step of this many rows). As large as vLLM's MLA context workspace (128K rows): a piece's cuDNN
# call builds a plan per new shape (~40-110 ms), so contexts that fit stay on the one-call path
MAX_EXPANDED_ROWS = 131072


def _prefill_bounded(q_nope: torch.Tensor, q_rope: torch.Tensor, pages: torch.Tensor, layer: int, page: torch.Tensor,
                     row: torch.Tensor, query_lens: list[int], context_lens: list[int], kv_b: torch.Tensor,
                     kv_lora_rank: int, v_head_dim: int, scale: float, split: bool | None, max_rows: int
                     ) -> torch.Tensor:
    """`mla_prefill_fast` expanding at most `max_rows` cached rows at a time: consecutive sequences grouped
    while their rows fit, a longer sequence through `_prefill_pieces`. On CUDA without the cuDNN attention
    that returns a log-sum-exp (the pieces' merge needs it), everything is expanded at once, as before."""
    h = q_nope.shape[1]
    out = torch.empty(q_nope.shape[0], h, v_head_dim, dtype=kv_b.dtype, device=pages.device)
    q_off, c_off = [0], [0]
    for nq, nc in zip(query_lens, context_lens):
        q_off.append(q_off[-1] + nq)
        c_off.append(c_off[-1] + nc)

    def group(i: int, j: int) -> None:  # sequences i..j-1, expanded at once
        if i < j:
            qs, cs = slice(q_off[i], q_off[j]), slice(c_off[i], c_off[j])
            out[qs] = _prefill_expanded(q_nope[qs], q_rope[qs], pages, layer, page[cs], row[cs], query_lens[i:j],
                                        context_lens[i:j], kv_b, kv_lora_rank, v_head_dim, scale, split)

    start = 0
    for i, nc in enumerate(context_lens):
        if nc > max_rows:
            group(start, i)
            qs, cs = slice(q_off[i], q_off[i + 1]), slice(c_off[i], c_off[i + 1])
            o = _prefill_pieces(q_nope[qs], q_rope[qs], pages, layer, page[cs], row[cs], kv_b, kv_lora_rank,
                                v_head_dim, scale, max_rows)
            if o is None:  # no attention with a log-sum-exp to merge pieces by on this device
                return _prefill_expanded(q_nope, q_rope, pages, layer, page, row, query_lens, context_lens, kv_b,
                                         kv_lora_rank, v_head_dim, scale, split)
            out[qs] = o
            start = i + 1
        elif c_off[i + 1] - c_off[start] > max_rows:
            group(start, i)
            start = i
    group(start, len(context_lens))
    return out


def _prefill_pieces(q_nope: torch.Tensor, q_rope: torch.Tensor, pages: torch.Tensor, layer: int, page: torch.Tensor,
                    row: torch.Tensor, kv_b: torch.Tensor, kv_lora_rank: int, v_head_dim: int, scale: float,
                    max_rows: int) -> torch.Tensor | None:
    """One chunk of L queries at the end of its S = page.numel() rows: its queries over the S - L cached rows,
    `max_rows` at a time without a mask, then over its own L rows causally, every part merged by log-sum-exp
    in fp32. [L, H, d_v]; None where no attention returning a log-sum-exp serves the inputs on CUDA (the
    math reference would materialize [H, L, max_rows] fp32 scores)."""
    h, nq = q_nope.shape[1], q_nope.shape[0]
    cached = page.numel() - nq
    q = torch.cat([q_nope, q_rope], -1).to(kv_b.dtype).transpose(0, 1).unsqueeze(0)  # [1, H, L, d]
    o_acc = lse_acc = None
    for s in [*range(0, cached, max_rows), cached]:
        e = min(cached, s + max_rows) if s < cached else page.numel()
        k, v = _expand(pages, layer, page[s:e], row[s:e], kv_b, kv_lora_rank, h, v_head_dim)
        mode = cudnn_split_mode(k, k, v)
        if mode is None and q.is_cuda:
            return None
        attend = reference_attention_lse if mode is None else cudnn_attention_lse
        v = split_values(v, mode or "narrow", k.shape[-1])
        o, lse = attend(q, k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0), s == cached, scale)
        o, lse = o[..., :v_head_dim].float(), lse.float()
        if o_acc is None:
            o_acc, lse_acc = o, lse
        else:
            o_acc = merge_attention(o_acc, lse_acc, o, lse)
            lse_acc = torch.logaddexp(lse_acc, lse)
    return o_acc[0].transpose(0, 1).to(kv_b.dtype)
