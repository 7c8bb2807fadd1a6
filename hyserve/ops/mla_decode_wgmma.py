"""The paged MLA decode split kernel written in Gluon: one warpgroup, cache rows as wgmma's M side, and
double buffering under the program's own control (docs/ARCHITECTURE.md §7; math: §4.3).

Why a second form of `mla_decode._mla_split_kernel` (its docstring has the measurements): in Triton the
"rows" form (both products wgmma) cannot overlap its tile copies with its products at 64-row tiles,
because the pipeliner issues the next copy after the products and keeps a buffer more than the stages
it is given; the "heads" form overlaps but runs mma.sync, whose warps re-read q from shared memory for
every tile. Gluon (Triton's explicit-layout dialect) lets the program say what the pipeliner would not:
- scoresᵀ [BN rows, BH heads] = Kc [BN, R] @ qcᵀ + Kr [BN, DR] @ qrᵀ, and accᵀ [R, BH] += Kcᵀ @ Pᵀ:
  M is the rows (64) and the latent columns (512), so both are wgmma of one warpgroup reading the
  tile and q once from shared memory; Pᵀ (4 KB) goes through shared memory, as wgmma's B must;
- two tile buffers: the copies of tile t + 1 are issued (cp.async, zero-filled past the context) before
  tile t's products, so one tile is always in flight while the other is read; `PREFETCH` tiles further
  ahead are pulled into L2 by one thread (cp.async.bulk.prefetch), so HBM keeps streaming;
- the split's block ids are read once and held by every warp (two a thread), so no load of the block
  table stands between two tiles.
Shared memory at BN = 64: 2 x 73.7 KB of tiles + 36.9 KB of q + 4 KB of Pᵀ: one program per SM. The
partials and log-sum-exps have the Triton kernel's format, so `mla_decode.combine_splits` merges them.
Requires Gluon (Triton >= 3.6) and a Hopper GPU; bf16/fp16 rows, heads per program <= 32.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma

from hyserve.ops.ptx import PREFETCH_L2_ASM


@gluon.jit
def _prefetch_l2(ptr, nbytes):
    """Thread 0 asks the copy engine to pull [ptr, ptr + nbytes) into L2; nothing waits for it."""
    gl.inline_asm_elementwise(PREFETCH_L2_ASM, "=r,l,r", [ptr, nbytes], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _tile_base(pages_ptr, s_pb, ids, ti, k, t, PER: gl.constexpr, BN: gl.constexpr, W: gl.constexpr):
    """First row of tile t, the split's k-th: its block id from the ids every warp holds."""
    blk = gl.sum(gl.where(ti == k, ids, 0), axis=0).to(gl.int64)
    return pages_ptr + blk * s_pb + (t % PER) * (BN * W)


@gluon.jit
def _issue_tile(kc_buf, kr_buf, base, first_row, end, BN: gl.constexpr, R: gl.constexpr, DR: gl.constexpr,
                W: gl.constexpr):
    """cp.async copies of a tile's rows into one buffer; rows at or past `end` are zero-filled (a page's
    unused rows may hold anything, NaN included, and a zero weight times NaN is NaN)."""
    ld_c: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
    ld_r: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    rc = gl.arange(0, BN, layout=gl.SliceLayout(1, ld_c))
    cc = gl.arange(0, R, layout=gl.SliceLayout(0, ld_c))
    async_copy.async_copy_global_to_shared(kc_buf, base + rc[:, None] * W + cc[None, :],
                                           mask=(first_row + rc < end)[:, None])
    rr = gl.arange(0, BN, layout=gl.SliceLayout(1, ld_r))
    cr = gl.arange(0, DR, layout=gl.SliceLayout(0, ld_r))
    async_copy.async_copy_global_to_shared(kr_buf, base + R + rr[:, None] * W + cr[None, :],
                                           mask=(first_row + rr < end)[:, None])


@gluon.jit(do_not_specialize=["S"])
def mla_split_wgmma_kernel(
    q_ptr, s_qn, s_qh, qr_ptr, s_rn, s_rh, pages_ptr, s_pb, bt_ptr, s_btn, ctx_ptr,
    o_ptr, s_on, s_os, s_oh, lse_ptr, s_ln, s_ls,
    H, qk_scale, S,
    BS: gl.constexpr, R: gl.constexpr, DR: gl.constexpr, BH: gl.constexpr, BN: gl.constexpr,
    PREFETCH: gl.constexpr, MAXT: gl.constexpr,
):
    """Program (n, split, head block): as `mla_decode._mla_split_kernel` (same arguments, same partials),
    4 warps."""
    n = gl.program_id(0)
    sp = gl.program_id(1)
    hb = gl.program_id(2)
    W: gl.constexpr = R + DR
    PER: gl.constexpr = BS // BN
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BH, 16])
    q_l: gl.constexpr = gl.BlockedLayout([8, 1], [32, 1], [1, 4], [0, 1])  # qᵀ: the latent is contiguous
    ids_l: gl.constexpr = gl.BlockedLayout([MAXT // 32], [32], [4], [0])  # each warp holds all MAXT
    dt = pages_ptr.dtype.element_ty
    kc_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, R], dt)
    kr_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, DR], dt)
    qc_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([R, BH], dt)
    qr_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([DR, BH], dt)
    p_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, BH], dt)

    ctx = gl.load(ctx_ptr + n).to(gl.int32)
    chunk = gl.cdiv(gl.cdiv(ctx, S), BN) * BN  # each sequence's own context over the S splits
    start = sp * chunk
    end = gl.minimum(start + chunk, ctx)
    t0 = start // BN
    nt = gl.minimum(gl.cdiv(end, BN), t0 + MAXT) - t0  # <= 0: an empty split
    ti = gl.arange(0, MAXT, layout=ids_l)
    ids = gl.load(bt_ptr + n * s_btn + (t0 + ti) // PER, mask=ti < nt, other=0).to(gl.int32)

    hq = hb * BH + gl.arange(0, BH, layout=gl.SliceLayout(0, q_l))
    rq = gl.arange(0, R, layout=gl.SliceLayout(1, q_l))
    dq = gl.arange(0, DR, layout=gl.SliceLayout(1, q_l))
    qc = gl.load(q_ptr + n * s_qn + hq[None, :] * s_qh + rq[:, None], mask=(hq < H)[None, :], other=0.0)
    qr = gl.load(qr_ptr + n * s_rn + hq[None, :] * s_rh + dq[:, None], mask=(hq < H)[None, :], other=0.0)
    qc_s = gl.allocate_shared_memory(dt, [R, BH], qc_sl, qc)
    qr_s = gl.allocate_shared_memory(dt, [DR, BH], qr_sl, qr)
    kc_s = gl.allocate_shared_memory(dt, [2, BN, R], kc_sl)
    kr_s = gl.allocate_shared_memory(dt, [2, BN, DR], kr_sl)
    p_s = gl.allocate_shared_memory(dt, [BN, BH], p_sl)

    tile_bytes = BN * W * (dt.primitive_bitwidth // 8)
    if nt > 0:
        _issue_tile(kc_s.index(0), kr_s.index(0), _tile_base(pages_ptr, s_pb, ids, ti, 0, t0, PER, BN, W),
                    t0 * BN, end, BN, R, DR, W)
    async_copy.commit_group()
    for j in gl.static_range(PREFETCH):
        if j + 1 < nt:
            _prefetch_l2(_tile_base(pages_ptr, s_pb, ids, ti, j + 1, t0 + j + 1, PER, BN, W), tile_bytes)

    m = gl.full([BH], float("-inf"), gl.float32, layout=gl.SliceLayout(0, mma))
    l_sum = gl.zeros([BH], gl.float32, layout=gl.SliceLayout(0, mma))
    acc = gl.zeros([R, BH], gl.float32, layout=mma)
    rows0 = gl.arange(0, BN, layout=gl.SliceLayout(1, mma))
    for i in range(0, nt):
        t = t0 + i
        gl.thread_barrier()  # every warp is past tile i - 1's products: its buffer may be refilled
        if i + 1 < nt:
            b = (i + 1) % 2
            _issue_tile(kc_s.index(b), kr_s.index(b), _tile_base(pages_ptr, s_pb, ids, ti, i + 1, t + 1, PER, BN, W),
                        (t + 1) * BN, end, BN, R, DR, W)
        async_copy.commit_group()
        if PREFETCH > 0:
            if i + 1 + PREFETCH < nt:
                _prefetch_l2(_tile_base(pages_ptr, s_pb, ids, ti, i + 1 + PREFETCH, t + 1 + PREFETCH, PER, BN, W),
                             tile_bytes)
        async_copy.wait_group(1)  # tile t's copies (this thread's) have landed
        gl.thread_barrier()  # and every thread's
        fence_async_shared()
        kc = kc_s.index(i % 2)
        sc = warpgroup_mma(kc, qc_s, gl.zeros([BN, BH], gl.float32, layout=mma))
        sc = warpgroup_mma(kr_s.index(i % 2), qr_s, sc)
        sc = gl.where((t * BN + rows0 < end)[:, None], sc * qk_scale, float("-inf"))  # log2 units
        m_new = gl.maximum(m, gl.max(sc, axis=0))  # finite: a tile holds at least one row
        alpha = gl.exp2(m - m_new)
        p = gl.exp2(sc - m_new[None, :])
        l_sum = l_sum * alpha + gl.sum(p, axis=0)
        p_s.store(p.to(dt))
        fence_async_shared()
        gl.thread_barrier()
        acc = warpgroup_mma(kc.permute((1, 0)), p_s, acc * alpha[None, :])
        m = m_new

    # a split that saw no row writes only lse = -inf and the combine reads no partial for it; split 0
    # writes zeros then (an empty context: the single-split result is that partial)
    hs = hb * BH + gl.arange(0, BH, layout=gl.SliceLayout(0, mma))
    has = l_sum > 0
    keep = has | (hs * 0 + sp == 0)
    lse = gl.where(has, m + gl.log2(gl.where(has, l_sum, 1.0)), float("-inf"))
    gl.store(lse_ptr + n * s_ln + sp * s_ls + hs, lse, mask=hs < H)
    out = acc / gl.where(has, l_sum, 1.0)[None, :]
    rs = gl.arange(0, R, layout=gl.SliceLayout(1, mma))
    gl.store(o_ptr + n * s_on + sp * s_os + hs[None, :] * s_oh + rs[:, None], out.to(o_ptr.dtype.element_ty),
             mask=((hs < H) & keep)[None, :])


def unsupported(q_full, pages, block_n: int, kv_lora_rank: int, dr: int) -> str | None:
    """Why this kernel cannot run the call (None: it can)."""
    import torch

    from hyserve.ops.dispatch import capability

    if not q_full.is_cuda or capability(q_full)[0] != 9:
        return "needs a Hopper GPU (wgmma)"
    if pages.dtype not in (torch.bfloat16, torch.float16):
        return f"rows in {pages.dtype}: bf16 or fp16 only"
    if block_n != 64 or pages.shape[1] % 64:
        return "64-row tiles inside pages of a multiple of 64 rows only"
    if kv_lora_rank % 64 or dr % 16:
        return "a latent width that is a multiple of 64 and a rope width that is a multiple of 16"
    return None


def launch_split(q_full, q_rope, pages, block_tables, context_lens, part, lse, qk_scale: float, prefetch: int,
                 max_tiles: int, bh: int) -> None:
    """One split program per (sequence, split, head block of bh <= 32 heads); writes part [N, S, H, R] and lse
    [N, S, H] as `mla_decode._mla_split_kernel` does."""
    n, h, _ = q_full.shape
    r, dr = part.shape[-1], q_rope.shape[-1]
    mla_split_wgmma_kernel[(n, part.shape[1], -(-h // bh))](
        q_full, q_full.stride(0), q_full.stride(1), q_rope, q_rope.stride(0), q_rope.stride(1), pages, pages.stride(0),
        block_tables, block_tables.stride(0), context_lens,
        part, *part.stride()[:3], lse, *lse.stride()[:2],
        h, qk_scale, part.shape[1],
        BS=pages.shape[1], R=r, DR=dr, BH=bh, BN=64, PREFETCH=prefetch, MAXT=max_tiles, num_warps=4,
    )
