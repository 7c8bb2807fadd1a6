"""Paged MLA decode in the absorbed form as Triton kernels (DESIGN.md §6; math: spec/models.md §2.5).

With q_full = [W_UKᵀ q_n | q_r] (576 values) every head attends to the same cache rows, so one program
handles a block of heads of one sequence and reads each packed page row once: the score is q_full·row
and the value is row[:512]. Long contexts are split over programs (split-K); a second small kernel
combines the partial outputs by log-sum-exp. The up-projections around it stay batched GEMMs in torch.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl


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


@triton.jit
def _mla_split_kernel(
    q_ptr, s_qn, s_qh, pages_ptr, s_pb, s_pr, bt_ptr, s_btn, ctx_ptr,
    o_ptr, s_on, s_os, s_oh, lse_ptr, s_ln, s_ls,
    H, qk_scale, S,
    BS: tl.constexpr, R: tl.constexpr, DR: tl.constexpr, BH: tl.constexpr, BN: tl.constexpr,
    IEEE: tl.constexpr,
):
    n = tl.program_id(0)
    sp = tl.program_id(1)
    hb = tl.program_id(2)
    ctx = tl.load(ctx_ptr + n)
    # each sequence's own context over the S splits (whole tiles): with S planned for a longer context
    # (a CUDA graph plans for max_model_len) a short one still spreads over programs, not into split 0
    chunk = tl.cdiv(tl.cdiv(ctx, S), BN) * BN
    start = sp * chunk
    end = tl.minimum(start + chunk, ctx)
    heads = hb * BH + tl.arange(0, BH)
    hmask = heads < H
    dr = tl.arange(0, R)
    dq = tl.arange(0, DR)
    qrow = q_ptr + n * s_qn + heads[:, None] * s_qh
    qc = tl.load(qrow + dr[None, :], mask=hmask[:, None], other=0.0)
    qr = tl.load(qrow + R + dq[None, :], mask=hmask[:, None], other=0.0)
    m = tl.full([BH], float("-inf"), tl.float32)
    l_sum = tl.zeros([BH], tl.float32)
    acc = tl.zeros([BH, R], tl.float32)
    for s0 in range(start, end, BN):
        pos = s0 + tl.arange(0, BN)
        pmask = pos < end
        blk = tl.load(bt_ptr + n * s_btn + pos // BS, mask=pmask, other=0).to(tl.int64)
        rows = pages_ptr + blk * s_pb + (pos % BS) * s_pr
        kc = tl.load(rows[:, None] + dr[None, :], mask=pmask[:, None], other=0.0)
        kr = tl.load(rows[:, None] + R + dq[None, :], mask=pmask[:, None], other=0.0)
        m, l_sum, acc = _softmax_tile(qc, qr, kc, kr, pmask, m, l_sum, acc, qk_scale, DR, IEEE)
    _store_split(o_ptr + n * s_on + sp * s_os, s_oh, lse_ptr + n * s_ln + sp * s_ls, heads, hmask, dr, m, l_sum, acc)


@triton.jit
def _mla_combine_kernel(
    o_ptr, s_on, s_os, s_oh, lse_ptr, s_ln, s_ls, out_ptr, s_outn, s_outh, S,
    BR: tl.constexpr, SP: tl.constexpr,
):
    """Program (n, h, rb): all splits of BR latent columns at once (one 2D load, no serial loop)."""
    n = tl.program_id(0)
    h = tl.program_id(1)
    rb = tl.program_id(2)
    s = tl.arange(0, SP)
    lse = tl.load(lse_ptr + n * s_ln + s * s_ls + h, mask=s < S, other=float("-inf"))
    wts = tl.exp2(lse - tl.max(lse, axis=0))
    wts = wts / tl.sum(wts, axis=0)
    dr = rb * BR + tl.arange(0, BR)
    part = tl.load(o_ptr + n * s_on + s[:, None] * s_os + h * s_oh + dr[None, :], mask=(s < S)[:, None], other=0.0)
    acc = tl.sum(part * wts[:, None], axis=0)
    tl.store(out_ptr + n * s_outn + h * s_outh + dr, acc.to(out_ptr.dtype.element_ty))


def mla_decode_latent(
    q_full: torch.Tensor, pages: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
    max_context: int, scale: float, kv_lora_rank: int, num_splits: int | None = None, block_n: int = 32,
    num_warps: int = 8, num_stages: int = 2,
) -> torch.Tensor:
    """Attention of q_full [N, H, R + d_r] over each sequence's cached rows; returns o_lat [N, H, R] fp32.

    pages is one layer's view [blocks, block_size, row] (row unit-stride); block_tables [N, B];
    context_lens [N] on the device; max_context bounds them on the host (a CUDA graph passes
    max_model_len) and sets the number of splits, over which each sequence spreads its own context.
    """
    n, h, width = q_full.shape
    r, dr = kv_lora_rank, width - kv_lora_rank
    assert q_full.stride(-1) == 1 and pages.stride(-1) == 1 and pages.shape[-1] == width
    bh = max(16, min(32, triton.next_power_of_2(h)))  # tl.dot needs >= 16 rows
    hblocks = triton.cdiv(h, bh)
    if num_splits is None:
        # enough programs to cover every multiprocessor about twice. Where splits of 512 rows already
        # fill the machine, none is shorter: below that its partial output costs more traffic than it
        # saves (measured at batch 64). Otherwise (batch 1, short contexts) the few programs walk their
        # rows one dependent tile at a time, about 40 µs for 540 rows in 2 splits (profiled), so splits
        # go down to 64 rows.
        sms = torch.cuda.get_device_properties(q_full.device).multi_processor_count if q_full.is_cuda else 132
        min_rows = 512 if n * hblocks * triton.cdiv(max_context, 512) >= sms else 64
        num_splits = max(1, min(triton.cdiv(2 * sms, n * hblocks), triton.cdiv(max_context, min_rows), 64))
    num_splits = max(1, min(num_splits, triton.cdiv(max(max_context, 1), block_n)))  # no split without a tile
    part = torch.empty(n, num_splits, h, r, dtype=torch.float32, device=q_full.device)
    lse = torch.empty(n, num_splits, h, dtype=torch.float32, device=q_full.device)
    _mla_split_kernel[(n, num_splits, hblocks)](
        q_full, q_full.stride(0), q_full.stride(1), pages, pages.stride(0), pages.stride(1),
        block_tables, block_tables.stride(0), context_lens,
        part, *part.stride()[:3], lse, *lse.stride()[:2],
        h, scale * math.log2(math.e), num_splits,
        BS=pages.shape[1], R=r, DR=dr, BH=bh, BN=block_n, IEEE=pages.dtype == torch.float32,
        num_warps=num_warps, num_stages=num_stages,
    )
    return combine_splits(part, lse)


def combine_splits(part: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """Merge split-K partial outputs part [N, S, H, R] by their log2-sum-exp lse [N, S, H]: [N, H, R] fp32."""
    n, num_splits, h, r = part.shape
    if num_splits == 1:
        return part[:, 0]
    out = torch.empty(n, h, r, dtype=torch.float32, device=part.device)
    br = min(r, 128)
    _mla_combine_kernel[(n, h, triton.cdiv(r, br))](
        part, *part.stride()[:3], lse, *lse.stride()[:2], out, out.stride(0), out.stride(1), num_splits,
        BR=br, SP=triton.next_power_of_2(num_splits), num_warps=4,
    )
    return out


def mla_absorbed_decode_fast(
    q_nope: torch.Tensor, q_rope: torch.Tensor, pages: torch.Tensor, layer: int, block_tables: torch.Tensor,
    context_lens: torch.Tensor, max_context: int, kv_b: torch.Tensor, kv_lora_rank: int, v_head_dim: int,
    scale: float,
) -> torch.Tensor:
    """Same contract as `mla_attention.mla_absorbed_decode` (plus max_context); returns o [N, H, d_v] in
    the model dtype. q_lat = W_UKᵀ q_n and o = W_UV o_lat are batched GEMMs over heads."""
    n, h, dn = q_nope.shape
    w = kv_b.view(h, dn + v_head_dim, kv_lora_rank)
    q_lat = torch.bmm(q_nope.transpose(0, 1), w[:, :dn])  # [H, N, R]
    q_full = torch.cat([q_lat.transpose(0, 1), q_rope.to(q_lat.dtype)], -1).to(pages.dtype)
    o_lat = mla_decode_latent(q_full, pages[:, layer], block_tables, context_lens, max_context, scale, kv_lora_rank)
    o = torch.bmm(o_lat.to(kv_b.dtype).transpose(0, 1), w[:, dn:].transpose(1, 2))  # [H, N, d_v]
    return o.transpose(0, 1)


def mla_prefill_fast(
    q_nope: torch.Tensor, q_rope: torch.Tensor, pages: torch.Tensor, layer: int, block_tables: torch.Tensor,
    query_lens: list[int], context_lens: list[int], kv_b: torch.Tensor, kv_lora_rank: int, v_head_dim: int,
    scale: float,
) -> torch.Tensor:
    """Expanded-form attention for prefill sequences laid end to end (q_* [Tq, H, d]).

    The cached rows of all sequences are gathered in one indexing op and up-projected by one GEMM;
    then one fused SDPA call per sequence (flash attention when the chunk starts at 0, else a causal
    offset mask). v is zero-padded to the q/k width so the flash kernel applies. Returns [Tq, H, d_v].
    """
    import torch.nn.functional as F

    dev, bs = pages.device, pages.shape[2]
    h, dn = q_nope.shape[1], q_nope.shape[2]
    ctx_t = torch.tensor(context_lens)  # built on the host and queued: torch.tensor(..., device=) syncs
    ctx_t = ctx_t.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else ctx_t
    total = sum(context_lens)
    starts = torch.cumsum(ctx_t, 0) - ctx_t
    seq = torch.repeat_interleave(torch.arange(len(context_lens), device=dev), ctx_t, output_size=total)
    pos = torch.arange(total, device=dev) - starts[seq]
    rows = pages[block_tables[seq, pos // bs], layer, pos % bs]  # [S, R + d_r]
    kv = (rows[:, :kv_lora_rank].to(kv_b.dtype) @ kv_b.t()).view(total, h, dn + v_head_dim)
    k = torch.cat([kv[..., :dn], rows[:, None, kv_lora_rank:].to(kv.dtype).expand(-1, h, -1)], -1)
    v = F.pad(kv[..., dn:], (0, k.shape[-1] - v_head_dim))
    q = torch.cat([q_nope, q_rope], -1).to(k.dtype)
    out = torch.empty(q.shape[0], h, v_head_dim, dtype=k.dtype, device=dev)
    q0 = c0 = 0
    for nq, nc in zip(query_lens, context_lens):
        qi = q[q0 : q0 + nq].transpose(0, 1).unsqueeze(0)
        ki = k[c0 : c0 + nc].transpose(0, 1).unsqueeze(0)
        vi = v[c0 : c0 + nc].transpose(0, 1).unsqueeze(0)
        if nq == nc:
            oi = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale)
        else:  # query j sits at position nc - nq + j
            mask = torch.ones(nq, nc, dtype=torch.bool, device=dev).tril(nc - nq)
            oi = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale)
        out[q0 : q0 + nq] = oi[0, :, :, :v_head_dim].transpose(0, 1)
        q0, c0 = q0 + nq, c0 + nc
    return out
