"""DSA index scores over the paged key cache and an exact tie-ruled top-k, in Triton
(docs/ARCHITECTURE.md §7; math: §4.4; torch reference: ops/dsa_indexer.py).

Stage 1 (one kernel): a program takes a block of BM query rows of one sequence and a chunk of key
positions. It loads the rows' FP8 queries once as a [BM*H, D] tile, then per tile of BN positions maps
each logical position to its page slot through the block table, reads the keys straight from the split
pages of `CacheTensors.index_keys` (dsa_indexer: a page's value parts, D e4m3 bytes or D/2 MXFP4 code
bytes per token in 16-byte-aligned rows, then its scale parts), computes
I[t,s] = s_k[s] · Σ_h w'[t,h] · ReLU(q8[t,h]·k[s]) with one tensor-core dot per tile (on a GPU an FP8
dot by default, within the R1 contract: see index_sort_keys; else e4m3 values in fp16 and E2M1·E8M0
values in bf16, exact, so only the fp32 accumulation order differs from the reference) and writes a
*composite sort key* per (t, s) rather than the score:

    key(t, s) = ord32(I[t,s]) << 32  |  (2^32 - 1 - s)

ord32 maps fp32 to int32 preserving order (negative floats get their magnitude bits flipped), and −0.0
is first made +0.0 so that it ties with +0.0 exactly as the reference's float sort does. Positions after
the row's own position (and past the sequence end) get the key of −inf. Keys are then unique and their
order is "score descending, position ascending" (docs/ARCHITECTURE.md §4.1), so stage 2 — `torch.topk` on the int64
keys — is exact: no tie is left for topk to break arbitrarily.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hyserve.ops import dsa_indexer as dsa
from hyserve.ops.kernel_plan import dsa_fp8_dot

_FMT_CODES = {"fp8": 0, "mxfp4": 1}
_LOW32 = 0xFFFFFFFF


@triton.jit
def _e4m3_bytes(b, DOT: tl.constexpr, DOT_F32: tl.constexpr):
    """e4m3 bytes as their values: fp16 (exact), the bytes themselves as e4m3 for the FP8 dot (DOT 2), or
    fp32 under the interpreter, which has no fp8 bitcast (sign, exponent, mantissa; no NaN is stored)."""
    if DOT_F32:
        b = b.to(tl.int32)
        e = (b >> 3) & 15
        m = (b & 7).to(tl.float32)
        mag = tl.where(e == 0, m * 0.001953125, (8.0 + m) * tl.exp2((e - 10).to(tl.float32)))
        return tl.where((b & 128) != 0, -mag, mag)
    f8 = b.to(tl.float8e4nv, bitcast=True)
    return f8 if DOT == 2 else f8.to(tl.float16)


@triton.jit
def _load_keys(kv_ptr, ks_ptr, page, slot, d, pmask, D: tl.constexpr, BS: tl.constexpr, FMT: tl.constexpr,
               DOT: tl.constexpr, DOT_F32: tl.constexpr):
    """Key tile [BN, D] (exact values in the dot's type) and per-position fp32 scale [BN] from split pages
    (dsa_indexer: a page's BS value parts, then its BS scale parts; `page` is the page's byte offset)."""
    if FMT == 0:  # FP8: D e4m3 bytes per token (16-byte-aligned rows), then BS fp32 scales
        b = tl.load(kv_ptr + page[:, None] + slot[:, None] * D + d[None, :], mask=pmask[:, None], other=0)
        k = _e4m3_bytes(b, DOT, DOT_F32)
        s_k = tl.load(ks_ptr + page // 4 + (BS * D) // 4 + slot, mask=pmask, other=0.0)
    else:  # MXFP4: byte d//2 holds element d in its low (even d) or high (odd d) nibble; bit 3 is the sign
        byte = tl.load(kv_ptr + page[:, None] + slot[:, None] * (D // 2) + d[None, :] // 2, mask=pmask[:, None],
                       other=0).to(tl.int32)
        nib = (byte >> ((d[None, :] % 2) * 4)) & 15
        e = (nib >> 1) & 3
        m = (nib & 1).to(tl.float32)
        mag = tl.where(e == 0, m * 0.5, (1.0 + m * 0.5) * tl.exp2((e - 1).to(tl.float32)))
        e_b = tl.load(kv_ptr + page[:, None] + BS * (D // 2) + slot[:, None] * (D // 32) + d[None, :] // 32,
                      mask=pmask[:, None], other=0)
        val = tl.where((nib & 8) != 0, -mag, mag) * tl.exp2(e_b.to(tl.float32) - 127.0)
        k = val if DOT_F32 else val.to(tl.bfloat16)  # E8M0 scales span fp32's range: bf16, not fp16
        s_k = tl.where(pmask, 1.0, 0.0)
    return k, s_k


@triton.jit
def _index_key_kernel(
    q_ptr, s_qt, s_qh, w_ptr, s_wt, kv_ptr, ks_ptr, s_kb,
    bt_ptr, s_btn, rb_seq_ptr, rb_tok_ptr, rb_n_ptr, qpos_ptr,
    out_ptr, s_ot, S, chunk,
    H: tl.constexpr, HP: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    BS: tl.constexpr, FMT: tl.constexpr, DOT: tl.constexpr, DOT_F32: tl.constexpr,
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

    # all BM rows x HP heads as one [BM*HP, D] operand: one dot per key tile serves every row
    r = tl.arange(0, BM * HP)
    rm = r // HP
    rh = r % HP
    rmask = (rm < ntok) & (rh < H)
    d = tl.arange(0, D)
    q = tl.load(q_ptr + (tok0 + rm)[:, None] * s_qt + rh[:, None] * s_qh + d[None, :], mask=rmask[:, None], other=0.0)
    w = tl.load(w_ptr + (tok0 + rm) * s_wt + rh, mask=rmask, other=0.0)  # 0 for padded heads and rows
    out_rows = out_ptr + (tok0 + mi).to(tl.int64)[:, None] * s_ot

    for s0 in range(start, k_end, BN):
        pos = s0 + tl.arange(0, BN)
        pmask = pos < k_end
        page = tl.load(bt_ptr + seq * s_btn + pos // BS, mask=pmask, other=0).to(tl.int64) * s_kb
        k, s_k = _load_keys(kv_ptr, ks_ptr, page, pos % BS, d, pmask, D, BS, FMT, DOT, DOT_F32)
        # keys as the dot's M side: BN (64-256) rows fill the tensor-core tile, the query's heads are its N
        dots = tl.dot(k, tl.trans(q))  # [BN, BM*HP] fp32
        part = tl.maximum(dots, 0.0) * w[None, :]
        if BM == 1:  # decode: no reshape, whose layout change would cost a round trip through shared memory
            score = tl.sum(part, axis=1)[None, :] * s_k[None, :]
        else:
            score = tl.trans(tl.sum(tl.reshape(part, (BN, BM, HP)), axis=2)) * s_k[None, :]  # [BM, BN]
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


def default_chunk(row_blocks: int, width: int, block_n: int) -> int:
    """Positions per program: about 4,096 programs over the step (many per SM, so that one program's
    pipeline start overlaps others' loads), at most 2,048 positions each, at least one tile."""
    want = max(1, row_blocks * width // 4096)
    return max(block_n, min(2048, 1 << (want.bit_length() - 1)))


def index_sort_keys(
    q8: torch.Tensor, w_folded: torch.Tensor, keys: torch.Tensor, layer: int, fmt: str,
    block_tables: torch.Tensor, query_lens: list[int], positions: torch.Tensor, width: int,
    block_m: int | None = None, block_n: int = 128, chunk: int | None = None, num_warps: int = 4,
    num_stages: int = 2, fp8_dot: bool | None = None,
) -> torch.Tensor:
    """Stage 1: composite keys [T, width] int64 of every (query row, position < width) pair.

    q8 [T, H, D] holds the e4m3 query values (any float dtype; exact in fp16), w_folded [T, H] fp32 the
    folded head weights (docs/ARCHITECTURE.md §4.4); keys is the whole `index_keys` pool [blocks, n_mla, BS, rec] uint8 in
    split pages; positions [T] the rows' absolute positions.

    FP8 keys on a GPU meet the queries in an FP8 tensor-core dot (`fp8_dot`, the default there): the
    products are exact but Hopper keeps fewer accumulator bits, so scores are about 2e-4 (relative) off the
    fp32 sums, inside the R1 contract's 1e-3 band around the k-th score (docs/ARCHITECTURE.md §4.4), and the kernel reads
    the keys 1.3-1.6x faster. `fp8_dot=False` (None: `kernel_plan.dsa_fp8_dot`, off with
    HYSERVE_DSA_EXACT_SCORES=1) takes an fp16 dot instead
    (e4m3 values are exact in fp16, sums in fp32: only their order differs from the reference).
    """
    t, h, d = q8.shape
    if fmt not in _FMT_CODES:
        raise ValueError(f"the Triton indexer reads 'fp8' or 'mxfp4' keys, not '{fmt}'")
    if keys.shape[-1] != dsa.key_record_bytes(fmt, d):
        raise ValueError(f"key records are {keys.shape[-1]} bytes, {fmt} with D={d} needs {dsa.key_record_bytes(fmt, d)}")
    if fp8_dot is None:
        fp8_dot = dsa_fp8_dot(fmt, d, q8.is_cuda)
    if fp8_dot and (fmt != "fp8" or not q8.is_cuda or d < 32):
        raise ValueError(f"the FP8 dot reads FP8 keys with D >= 32 on a GPU, not {fmt} keys with D={d} on {q8.device}")
    hp = triton.next_power_of_2(h)
    decode = all(n == 1 for n in query_lens)
    bm = block_m or (1 if decode else max(1, 128 // hp))
    bm = max(bm, 16 // min(hp, 16))  # tl.dot needs at least 16 rows
    rb_seq, rb_tok, rb_n = _row_blocks(query_lens, q8.device, bm)
    # Triton's CPU interpreter multiplies 16-bit tiles as raw integers: it gets fp32 operands (equally exact)
    dot_f32 = not q8.is_cuda
    dot = 2 if fp8_dot else 0 if fmt == "fp8" else 1
    qtype = torch.float32 if dot_f32 else (torch.float16, torch.bfloat16, torch.float8_e4m3fn)[dot]
    q = q8.to(qtype).contiguous()
    w = w_folded.float().contiguous()
    kv = keys[:, layer]  # [blocks, BS, rec] bytes; the same memory as fp32 words for the FP8 scales
    ks = kv.view(torch.float32) if fmt == "fp8" else kv
    out = torch.empty(t, width, dtype=torch.int64, device=q8.device)
    chunk = default_chunk(rb_seq.shape[0], width, block_n) if chunk is None else chunk
    chunk = triton.cdiv(chunk, block_n) * block_n
    grid = (rb_seq.shape[0], triton.cdiv(max(width, 1), chunk))
    _index_key_kernel[grid](
        q, q.stride(0), q.stride(1), w, w.stride(0), kv, ks, kv.stride(0),
        block_tables, block_tables.stride(0), rb_seq, rb_tok, rb_n, positions.contiguous(),
        out, out.stride(0), width, chunk,
        H=h, HP=hp, D=d, BM=bm, BN=block_n, BS=keys.shape[2], FMT=_FMT_CODES[fmt], DOT=dot, DOT_F32=dot_f32,
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
    fp8_dot: bool | None = None,
) -> torch.Tensor:
    """Selected positions [T, min(topk, max context)] long (-1 = none) for the step's query rows.

    q [T, H, D] index queries (model dtype), w [T, H] fp32 head weights including H^-1/2. Queries are
    quantised by the byte-exact torch quantiser (one small elementwise pass), keys are read in place.
    Stage 1 writes [rows, width] int64 sort keys: a step with more rows than fit in
    `dsa.WORKSPACE_BYTES` (a long prefill) is taken in groups of rows, each as wide as its last position.
    fp8_dot: see `index_sort_keys` (the layer passes its kernel plan's choice).
    """
    q8, w_folded = dsa.quantize_queries(q, w, ue8m0)
    width = max(context_lens)
    cap = max(1, dsa.WORKSPACE_BYTES // (16 * width))  # the keys and torch.topk's copy of them
    if len(query_lens) == q.shape[0] or q.shape[0] <= cap:  # decode, or small enough: one pass
        comp = index_sort_keys(q8, w_folded, keys, layer, fmt, block_tables, query_lens, positions, width,
                               fp8_dot=fp8_dot)
        return topk_from_sort_keys(comp, positions, topk)
    out = torch.full((q.shape[0], min(topk, width)), -1, dtype=torch.long, device=q.device)
    for tok0, tok1, seqs, lens, hi in _row_groups(query_lens, context_lens, cap):
        rows = slice(tok0, tok1)
        tables = block_tables[torch.tensor(seqs, device=block_tables.device)]
        comp = index_sort_keys(q8[rows], w_folded[rows], keys, layer, fmt, tables, lens, positions[rows], hi,
                               fp8_dot=fp8_dot)
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
