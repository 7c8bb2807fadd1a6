"""DSA index scores over the paged key cache and an exact tie-ruled top-k, in Triton (DESIGN.md §6;
math: spec/models.md §4.3-§4.4; torch reference: ops/dsa_indexer.py).

Stage 1 (one kernel): a program takes a block of BM query rows of one sequence and a chunk of key
positions. It loads the rows' FP8 queries once as a [BM*H, D] tile, then per tile of BN positions maps
each logical position to its page slot through the block table, reads the key records straight from
`CacheTensors.index_keys` (FP8: D e4m3 bytes + fp32 scale; MXFP4: D/2 code bytes + D/32 E8M0 bytes),
computes I[t,s] = s_k[s] · Σ_h w'[t,h] · ReLU(q8[t,h]·k[s]) with one tensor-core dot (e4m3 and E2M1
values are exact in bf16, so the products are exact and only the fp32 accumulation order differs from
the reference) and writes a *composite sort key* per (t, s) rather than the score:

    key(t, s) = ord32(I[t,s]) << 32  |  (2^32 - 1 - s)

ord32 maps fp32 to int32 preserving order (negative floats get their magnitude bits flipped), and −0.0
is first made +0.0 so that it ties with +0.0 exactly as the reference's float sort does. Positions after
the row's own position (and past the sequence end) get the key of −inf. Keys are then unique and their
order is "score descending, position ascending" (spec §1.6), so stage 2 — `torch.topk` on the int64
keys — is exact: no tie is left for topk to break arbitrarily.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hyserve.ops import dsa_indexer as dsa

_FMT_CODES = {"fp8": 0, "mxfp4": 1}
_LOW32 = 0xFFFFFFFF


@triton.jit
def _load_keys(kb_ptr, ks_ptr, rec, rec32, d, pmask, D: tl.constexpr, FMT: tl.constexpr, DOT_F32: tl.constexpr):
    """Key tile [BN, D] as bf16 (exact; fp32 under the interpreter) and its per-position fp32 scale [BN]."""
    if FMT == 0:
        k = tl.load(kb_ptr + rec[:, None] + d[None, :], mask=pmask[:, None], other=0.0)
        s_k = tl.load(ks_ptr + rec32 + D // 4, mask=pmask, other=0.0)
    else:
        # MXFP4: byte d//2 holds element d in its low (even d) or high (odd d) nibble; bit 3 is the sign
        byte = tl.load(kb_ptr + rec[:, None] + d[None, :] // 2, mask=pmask[:, None], other=0).to(tl.int32)
        nib = (byte >> ((d[None, :] % 2) * 4)) & 15
        e = (nib >> 1) & 3
        m = (nib & 1).to(tl.float32)
        mag = tl.where(e == 0, m * 0.5, (1.0 + m * 0.5) * tl.exp2((e - 1).to(tl.float32)))
        e_b = tl.load(kb_ptr + rec[:, None] + D // 2 + d[None, :] // 32, mask=pmask[:, None], other=0)
        val = tl.where((nib & 8) != 0, -mag, mag) * tl.exp2(e_b.to(tl.float32) - 127.0)
        k = val
        s_k = tl.where(pmask, 1.0, 0.0)
    return k.to(tl.float32 if DOT_F32 else tl.bfloat16), s_k


@triton.jit
def _e4m3_lane(words, J: tl.constexpr, DOT_F32: tl.constexpr):
    """Byte J of every int32 word as its e4m3 value (bf16, exact; fp32 under the interpreter)."""
    b = (words >> (8 * J)) & 255
    if DOT_F32:  # the interpreter has no fp8 bitcast: decode sign, exponent and mantissa (no NaN is stored)
        e = (b >> 3) & 15
        m = (b & 7).to(tl.float32)
        mag = tl.where(e == 0, m * 0.001953125, (8.0 + m) * tl.exp2((e - 10).to(tl.float32)))
        return tl.where((b & 128) != 0, -mag, mag)
    return b.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.bfloat16)


@triton.jit
def _word_dots(q0, q1, q2, q3, kw_ptr, rec32, dw, pmask, DOT_F32: tl.constexpr):
    """Σ_d q[r, d]·k[s, d] for an FP8 key tile read as int32 words [BN, D/4]: 4-byte loads (the 132-byte
    records are only word-aligned, so byte loads could not be vectorised or pipelined). Byte lane j of
    word i is element 4i+j; qj holds the query's elements 4i+j."""
    words = tl.load(kw_ptr + rec32[:, None] + dw[None, :], mask=pmask[:, None], other=0)
    dots = tl.dot(q0, tl.trans(_e4m3_lane(words, 0, DOT_F32)))
    dots = tl.dot(q1, tl.trans(_e4m3_lane(words, 1, DOT_F32)), dots)
    dots = tl.dot(q2, tl.trans(_e4m3_lane(words, 2, DOT_F32)), dots)
    return tl.dot(q3, tl.trans(_e4m3_lane(words, 3, DOT_F32)), dots)


@triton.jit
def _index_key_kernel(
    q_ptr, s_qt, s_qh, w_ptr, s_wt,
    kb_ptr, s_kb, s_kr, ks_ptr, s_sb, s_sr,
    bt_ptr, s_btn, rb_seq_ptr, rb_tok_ptr, rb_n_ptr, qpos_ptr,
    out_ptr, s_ot, S, chunk,
    H: tl.constexpr, HP: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    BS: tl.constexpr, FMT: tl.constexpr, DOT_F32: tl.constexpr, WORDS: tl.constexpr,
):
    rb = tl.program_id(0)
    c = tl.program_id(1)
    seq = tl.load(rb_seq_ptr + rb)
    tok0 = tl.load(rb_tok_ptr + rb)
    ntok = tl.load(rb_n_ptr + rb)
    mi = tl.arange(0, BM)
    mvalid = mi < ntok
    qpos = tl.load(qpos_ptr + tok0 + mi, mask=mvalid, other=-1)
    hi = tl.max(qpos, axis=0) + 1  # positions >= hi are in no row's causal window
    start = c * chunk
    end = tl.minimum(start + chunk, S)
    k_end = tl.maximum(tl.minimum(end, hi), start)

    # all BM rows x HP heads as one [BM*HP, D] tile: one dot per key tile serves every row
    r = tl.arange(0, BM * HP)
    rm = r // HP
    rh = r % HP
    rmask = (rm < ntok) & (rh < H)
    d = tl.arange(0, D)
    q_rows = q_ptr + (tok0 + rm)[:, None] * s_qt + rh[:, None] * s_qh
    if WORDS:  # the query as four lanes of D/4 elements, matching the byte lanes of the key words
        dw = tl.arange(0, D // 4)
        q_lanes = q_rows + 4 * dw[None, :]
        q0 = tl.load(q_lanes + 0, mask=rmask[:, None], other=0.0)
        q1 = tl.load(q_lanes + 1, mask=rmask[:, None], other=0.0)
        q2 = tl.load(q_lanes + 2, mask=rmask[:, None], other=0.0)
        q3 = tl.load(q_lanes + 3, mask=rmask[:, None], other=0.0)
    else:
        q = tl.load(q_rows + d[None, :], mask=rmask[:, None], other=0.0)
    w = tl.load(w_ptr + (tok0 + rm) * s_wt + rh, mask=rmask, other=0.0)  # 0 for padded heads and rows
    out_rows = out_ptr + (tok0 + mi).to(tl.int64)[:, None] * s_ot

    for s0 in range(start, k_end, BN):
        pos = s0 + tl.arange(0, BN)
        pmask = pos < k_end
        blk = tl.load(bt_ptr + seq * s_btn + pos // BS, mask=pmask, other=0).to(tl.int64)
        slot = pos % BS
        if WORDS:
            rec32 = blk * s_sb + slot * s_sr
            dots = _word_dots(q0, q1, q2, q3, kb_ptr, rec32, dw, pmask, DOT_F32)  # kb: the int32 view
            s_k = tl.load(ks_ptr + rec32 + D // 4, mask=pmask, other=0.0)
        else:
            k, s_k = _load_keys(kb_ptr, ks_ptr, blk * s_kb + slot * s_kr, blk * s_sb + slot * s_sr, d, pmask, D, FMT,
                                DOT_F32)
            dots = tl.dot(q, tl.trans(k))  # [BM*HP, BN] fp32
        part = tl.maximum(dots, 0.0) * w[:, None]
        score = tl.sum(tl.reshape(part, (BM, HP, BN)), axis=1) * s_k[None, :]  # [BM, BN]
        score = tl.where(score == 0.0, 0.0, score)  # -0.0 -> +0.0: ties with +0.0 as in a float sort
        causal = (pos[None, :] <= qpos[:, None]) & (pos[None, :] < end)
        score = tl.where(causal, score, float("-inf"))
        bits = tl.cast(score, tl.int32, bitcast=True)
        okey = bits ^ ((bits >> 31) & 0x7FFFFFFF)
        comp = (okey.to(tl.int64) << 32) | (4294967295 - pos.to(tl.int64))[None, :]
        tl.store(out_rows + pos[None, :], comp, mask=mvalid[:, None] & (pos < end)[None, :])

    # the rest of the chunk lies after every row's position: the key of -inf, no cache reads
    ninf_key = -2139095041  # ord32(-inf) = 0xFF800000 ^ 0x7FFFFFFF as int32
    s1 = start + tl.cdiv(k_end - start, BN) * BN
    for s0 in range(s1, end, BN):
        pos = s0 + tl.arange(0, BN)
        comp = (tl.full([BM, BN], ninf_key, tl.int64) << 32) | (4294967295 - pos.to(tl.int64))[None, :]
        tl.store(out_rows + pos[None, :], comp, mask=mvalid[:, None] & (pos < end)[None, :])


def _row_blocks(
    query_lens: list[int], device: torch.device, bm: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sequence, first token, rows) of every block of <= bm query rows; a block never spans sequences."""
    if all(n == 1 for n in query_lens):  # decode, a block per row: built on the device (no host copy
        # to synchronise, so CUDA graphs can capture it) whatever bm the head count asked for
        ar = torch.arange(len(query_lens), device=device, dtype=torch.int32)
        return ar, ar, torch.ones_like(ar)
    q = torch.tensor(query_lens, dtype=torch.long)
    cu = torch.cumsum(q, 0) - q
    nblk = (q + bm - 1) // bm
    seq = torch.repeat_interleave(torch.arange(len(query_lens)), nblk)
    j = torch.arange(int(nblk.sum())) - (torch.cumsum(nblk, 0) - nblk)[seq]
    tok0 = cu[seq] + j * bm
    ntok = torch.clamp(q[seq] - j * bm, max=bm)
    return tuple(x.to(torch.int32).to(device) for x in (seq, tok0, ntok))  # type: ignore[return-value]


def index_sort_keys(
    q8: torch.Tensor, w_folded: torch.Tensor, keys: torch.Tensor, layer: int, fmt: str,
    block_tables: torch.Tensor, query_lens: list[int], positions: torch.Tensor, width: int,
    block_m: int | None = None, block_n: int = 64, chunk: int = 1024, num_warps: int = 4,
    words: bool | None = None, num_stages: int = 3,
) -> torch.Tensor:
    """Stage 1: composite keys [T, width] int64 of every (query row, position < width) pair.

    q8 [T, H, D] holds the e4m3 query values (any float dtype; cast to bf16, exact), w_folded [T, H]
    fp32 the folded head weights (spec §4.4); keys is the whole `index_keys` pool [blocks, n_mla, BS, rec]
    uint8; positions [T] the rows' absolute positions.
    """
    t, h, d = q8.shape
    if fmt not in _FMT_CODES:
        raise ValueError(f"the Triton indexer reads 'fp8' or 'mxfp4' keys, not '{fmt}'")
    if keys.shape[-1] != dsa.key_record_bytes(fmt, d):
        raise ValueError(f"key records are {keys.shape[-1]} bytes, {fmt} with D={d} needs {dsa.key_record_bytes(fmt, d)}")
    hp = triton.next_power_of_2(h)
    decode = all(n == 1 for n in query_lens)
    bm = block_m or (1 if decode else max(1, 128 // hp))
    bm = max(bm, 16 // min(hp, 16))  # tl.dot needs at least 16 rows
    rb_seq, rb_tok, rb_n = _row_blocks(query_lens, q8.device, bm)
    # Triton's CPU interpreter multiplies bf16 tiles as raw uint16: it gets fp32 operands (equally exact)
    dot_f32 = not q8.is_cuda
    q = q8.to(torch.float32 if dot_f32 else torch.bfloat16).contiguous()
    w = w_folded.float().contiguous()
    # FP8 keys as int32 words (4-byte loads; tl.dot needs D/4 >= 16) unless told otherwise
    words = fmt == "fp8" and d >= 64 if words is None else words
    if words and (fmt != "fp8" or d < 64):
        raise ValueError(f"word loads read FP8 keys with D >= 64, not {fmt} with D={d}")
    if fmt == "fp8":  # typed views of the same bytes: e4m3 values (or words), and the fp32 scale at word D/4
        kb = keys.view(torch.int32 if words else torch.float8_e4m3fn)[:, layer]
        ks = keys.view(torch.float32)[:, layer]
    else:
        kb = ks = keys[:, layer]
    out = torch.empty(t, width, dtype=torch.int64, device=q8.device)
    chunk = triton.cdiv(chunk, block_n) * block_n
    grid = (rb_seq.shape[0], triton.cdiv(max(width, 1), chunk))
    _index_key_kernel[grid](
        q, q.stride(0), q.stride(1), w, w.stride(0),
        kb, kb.stride(0), kb.stride(1), ks, ks.stride(0), ks.stride(1),
        block_tables, block_tables.stride(0), rb_seq, rb_tok, rb_n, positions.contiguous(),
        out, out.stride(0), width, chunk,
        H=h, HP=hp, D=d, BM=bm, BN=block_n, BS=keys.shape[2], FMT=_FMT_CODES[fmt], DOT_F32=dot_f32, WORDS=words,
        num_warps=num_warps, num_stages=num_stages,
    )
    return out


def topk_from_sort_keys(comp: torch.Tensor, positions: torch.Tensor, k: int) -> torch.Tensor:
    """Stage 2: the top-k positions per row in (score desc, position asc) order, -1 past the row's own
    position — the same contract as `dsa_indexer.topk_causal`. The keys are unique, so topk is exact."""
    vals = torch.topk(comp, min(k, comp.shape[-1]), dim=-1, sorted=True).values
    idx = _LOW32 - (vals & _LOW32)
    return torch.where(idx > positions[:, None], -1, idx)


def index_topk_fast(
    q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, layer: int, fmt: str, block_tables: torch.Tensor,
    query_lens: list[int], context_lens: list[int], positions: torch.Tensor, topk: int, ue8m0: bool = False,
) -> torch.Tensor:
    """Selected positions [T, min(topk, max context)] long (-1 = none) for the step's query rows.

    q [T, H, D] index queries (model dtype), w [T, H] fp32 head weights including H^-1/2. Queries are
    quantised by the byte-exact torch quantiser (one small elementwise pass), keys are read in place.
    Stage 1 writes [rows, width] int64 sort keys: a step with more rows than fit in
    `dsa.WORKSPACE_BYTES` (a long prefill) is taken in groups of rows, each as wide as its last position.
    """
    q8, w_folded = dsa.quantize_queries(q, w, ue8m0)
    width = max(context_lens)
    cap = max(1, dsa.WORKSPACE_BYTES // (16 * width))  # the keys and torch.topk's copy of them
    if len(query_lens) == q.shape[0] or q.shape[0] <= cap:  # decode, or small enough: one pass
        comp = index_sort_keys(q8, w_folded, keys, layer, fmt, block_tables, query_lens, positions, width)
        return topk_from_sort_keys(comp, positions, topk)
    out = torch.full((q.shape[0], min(topk, width)), -1, dtype=torch.long, device=q.device)
    for tok0, tok1, seqs, lens, hi in _row_groups(query_lens, context_lens, cap):
        rows = slice(tok0, tok1)
        tables = block_tables[torch.tensor(seqs, device=block_tables.device)]
        comp = index_sort_keys(q8[rows], w_folded[rows], keys, layer, fmt, tables, lens, positions[rows], hi)
        sel = topk_from_sort_keys(comp, positions[rows], topk)
        out[rows, : sel.shape[1]] = sel
    return out


def _row_groups(query_lens: list[int], context_lens: list[int], cap: int):
    """Consecutive token ranges of `cap` rows (the last may be shorter), filled greedily: (first token, end
    token, the sequence of each piece, each piece's rows, one past the group's last position). A sequence's
    rows may be split over groups; its new tokens sit at positions context - query_len onwards."""
    tok, group = 0, [0, 0, [], [], 0]
    for i, (n, ctx) in enumerate(zip(query_lens, context_lens)):
        a = 0
        while a < n:
            rows = min(n - a, cap - (group[1] - group[0]))
            group[1] += rows
            group[2].append(i)
            group[3].append(rows)
            group[4] = max(group[4], ctx - n + a + rows)
            a, tok = a + rows, tok + rows
            if group[1] - group[0] == cap:
                yield group
                group = [tok, tok, [], [], 0]
    if group[1] > group[0]:
        yield group


def sort_key_scores(comp: torch.Tensor) -> torch.Tensor:
    """Inverse of the composite key's high half: the fp32 scores (tests and debugging)."""
    okey = (comp >> 32).to(torch.int32)
    bits = okey ^ ((okey >> 31) & 0x7FFFFFFF)
    return bits.view(torch.float32)
