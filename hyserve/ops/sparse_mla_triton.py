"""Sparse absorbed MLA over the selected rows of the paged latent cache, in Triton
(docs/ARCHITECTURE.md §7; math: §4.4; torch reference: ops/sparse_mla.py).

The dense decode kernel (ops/mla_decode.py) walks a sequence's positions in order; here each query row
walks its own index list instead (request-local positions, -1 = padding), mapping every position to its
page slot through the sequence's block table. One program takes one query row, one block of heads and
one split of the index list, so a decode row and a prefill row are the same work item and prefill needs
no second kernel. All heads of the block share each gathered 576-dim row (MQA): the score is
q_full·row and the value is row[:512]. Splits are merged by the dense path's log-sum-exp combine kernel.

FP8 pages (576 e4m3 values, one fp32 scale per layer, docs/ARCHITECTURE.md §4.8) are widened to bf16 in registers
(exact); the layer scale is folded into the softmax scale and applied once to o_lat.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from hyserve.ops.mla_decode import _softmax_tile, _store_split, combine_splits


@triton.jit
def _sparse_mla_split_kernel(
    q_ptr, s_qt, s_qh, pages_ptr, s_pb, s_pr, bt_ptr, s_btn, seq_ptr, idx_ptr, s_it,
    o_ptr, s_ot, s_os, s_oh, lse_ptr, s_lt, s_ls,
    H, K, qk_scale, chunk,
    BS: tl.constexpr, R: tl.constexpr, DR: tl.constexpr, BH: tl.constexpr, BN: tl.constexpr,
    IEEE: tl.constexpr, WIDEN: tl.constexpr,  # WIDEN: 0 as stored, 1 to bf16, 2 to fp32
):
    t = tl.program_id(0)
    sp = tl.program_id(1)
    hb = tl.program_id(2)
    seq = tl.load(seq_ptr + t)
    start = sp * chunk
    end = tl.minimum(start + chunk, K)
    heads = hb * BH + tl.arange(0, BH)
    hmask = heads < H
    dr = tl.arange(0, R)
    dq = tl.arange(0, DR)
    qrow = q_ptr + t * s_qt + heads[:, None] * s_qh
    qc = tl.load(qrow + dr[None, :], mask=hmask[:, None], other=0.0)
    qr = tl.load(qrow + R + dq[None, :], mask=hmask[:, None], other=0.0)
    m = tl.full([BH], float("-inf"), tl.float32)
    l_sum = tl.zeros([BH], tl.float32)
    acc = tl.zeros([BH, R], tl.float32)
    for j0 in range(start, end, BN):
        j = j0 + tl.arange(0, BN)
        pos = tl.load(idx_ptr + t * s_it + j, mask=j < end, other=-1)
        valid = pos >= 0
        pos = tl.maximum(pos, 0)
        blk = tl.load(bt_ptr + seq * s_btn + pos // BS, mask=valid, other=0).to(tl.int64)
        rows = pages_ptr + blk * s_pb + (pos % BS) * s_pr
        kc = tl.load(rows[:, None] + dr[None, :], mask=valid[:, None], other=0.0)
        kr = tl.load(rows[:, None] + R + dq[None, :], mask=valid[:, None], other=0.0)
        if WIDEN == 1:  # e4m3 -> bf16 is exact; the layer scale is applied outside the dots
            kc = kc.to(tl.bfloat16)
            kr = kr.to(tl.bfloat16)
        elif WIDEN == 2:
            kc = kc.to(tl.float32)
            kr = kr.to(tl.float32)
        m, l_sum, acc = _softmax_tile(qc, qr, kc, kr, valid, m, l_sum, acc, qk_scale, DR, IEEE)
    _store_split(o_ptr + t * s_ot + sp * s_os, s_oh, lse_ptr + t * s_lt + sp * s_ls, heads, hmask, dr, m, l_sum, acc)


def sparse_mla_latent(
    q_full: torch.Tensor, pages: torch.Tensor, block_tables: torch.Tensor, token_seq: torch.Tensor,
    indices: torch.Tensor, scale: float, kv_lora_rank: int, kv_scale: float = 1.0,
    num_splits: int | None = None, block_n: int = 32, num_warps: int = 8, num_stages: int = 2,
) -> torch.Tensor:
    """Attention of q_full [T, H, R + d_r] over the rows its index list names; returns o_lat [T, H, R] fp32.

    pages is one layer's view [blocks, block_size, row] (row unit-stride; bf16, fp32 or e4m3);
    block_tables [N, B]; token_seq [T] each row's sequence; indices [T, k] request-local positions, -1 =
    none (every row needs at least one). kv_scale is the FP8 layer scale (1.0 for bf16/fp32 pages).
    """
    t, h, width = q_full.shape
    k = indices.shape[-1]
    r, dr = kv_lora_rank, width - kv_lora_rank
    assert q_full.stride(-1) == 1 and pages.stride(-1) == 1 and pages.shape[-1] == width
    if not q_full.is_cuda:  # Triton's CPU interpreter multiplies bf16 tiles as raw uint16: use fp32
        widen, dot_dtype = (0 if pages.dtype == torch.float32 else 2), torch.float32
    elif pages.dtype == torch.float8_e4m3fn:
        widen, dot_dtype = 1, torch.bfloat16
    else:
        widen, dot_dtype = 0, pages.dtype
    q = q_full.to(dot_dtype)
    bh = max(16, min(32, triton.next_power_of_2(h)))  # tl.dot needs >= 16 rows
    hblocks = triton.cdiv(h, bh)
    if num_splits is None:
        # enough programs to cover every multiprocessor about twice, but no split under 4 tiles
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 132
        num_splits = max(1, min(triton.cdiv(2 * sms, t * hblocks), triton.cdiv(k, 4 * block_n), 64))
    chunk = triton.cdiv(triton.cdiv(max(k, 1), num_splits), block_n) * block_n
    num_splits = max(1, triton.cdiv(max(k, 1), chunk))
    part = torch.empty(t, num_splits, h, r, dtype=torch.float32, device=q.device)
    lse = torch.empty(t, num_splits, h, dtype=torch.float32, device=q.device)
    _sparse_mla_split_kernel[(t, num_splits, hblocks)](
        q, q.stride(0), q.stride(1), pages, pages.stride(0), pages.stride(1),
        block_tables, block_tables.stride(0), token_seq, indices, indices.stride(0),
        part, *part.stride()[:3], lse, *lse.stride()[:2],
        h, k, scale * kv_scale * math.log2(math.e), chunk,
        BS=pages.shape[1], R=r, DR=dr, BH=bh, BN=block_n, IEEE=dot_dtype == torch.float32, WIDEN=widen,
        num_warps=num_warps, num_stages=num_stages,
    )
    out = combine_splits(part, lse)
    return out * kv_scale if kv_scale != 1.0 else out


def sparse_mla_fast(
    q_nope: torch.Tensor, q_rope: torch.Tensor, pages: torch.Tensor, layer: int, block_tables: torch.Tensor,
    token_seq: torch.Tensor, indices: torch.Tensor, kv_b: torch.Tensor, kv_lora_rank: int, v_head_dim: int,
    scale: float, kv_scale: float = 1.0,
) -> torch.Tensor:
    """The contract of `sparse_mla.sparse_mla` with the sequence's table given once per sequence
    (block_tables [N, B] and token_seq [T]) instead of once per token; returns o [T, H, d_v] in the
    model dtype. q_lat = W_UKᵀ q_n and o = W_UV o_lat are batched GEMMs over heads."""
    t, h, dn = q_nope.shape
    w = kv_b.view(h, dn + v_head_dim, kv_lora_rank)
    q_lat = torch.bmm(q_nope.transpose(0, 1), w[:, :dn])  # [H, T, R]
    q_full = torch.cat([q_lat.transpose(0, 1), q_rope.to(q_lat.dtype)], -1)
    o_lat = sparse_mla_latent(
        q_full, pages[:, layer], block_tables, token_seq, indices.contiguous(), scale, kv_lora_rank, kv_scale
    )
    o = torch.bmm(o_lat.to(kv_b.dtype).transpose(0, 1), w[:, dn:].transpose(1, 2))  # [H, T, d_v]
    return o.transpose(0, 1)
