"""MLA attention over the paged latent cache (docs/ARCHITECTURE.md §4.3), torch reference.

A cache row is [c (R) | k_r (d_r)]. The expanded form (prefill) up-projects the context; the absorbed
form (decode) is MQA with a (R + d_r)-dim query against the rows. They agree up to rounding.
"""

from __future__ import annotations

import torch


def gather_rows(pages: torch.Tensor, layer: int, block_table: torch.Tensor, n: int) -> torch.Tensor:
    """Rows of positions 0..n-1 of one sequence: [n, row] (pages [blocks, layers, bs, row])."""
    bs = pages.shape[2]
    pos = torch.arange(n, device=pages.device)
    return pages[block_table[pos // bs], layer, pos % bs]


def paged_rows(block_tables: torch.Tensor, context_lens: list[int], block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(page, row in the page) of positions 0..c_i-1 of every sequence i, sequence after sequence, from
    host lengths (no read-back of the device's); `pages[page, layer, row]` gathers them in one op."""
    dev = block_tables.device
    ctx = torch.tensor(context_lens, dtype=torch.long)
    ctx = ctx.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else ctx  # device= would sync
    total = sum(context_lens)
    seq = torch.repeat_interleave(torch.arange(len(context_lens), device=dev), ctx, output_size=total)
    pos = torch.arange(total, device=dev) - (torch.cumsum(ctx, 0) - ctx)[seq]
    return block_tables[seq, pos // block_size], pos % block_size


# fp32 scores of one query chunk at most: a chunk of thousands of queries over a long context would
# otherwise ask for gigabytes beside a cache already sized to the rest of the device
SCORES_BYTES = 1 << 27


def mla_expanded(
    q_nope: torch.Tensor, q_rope: torch.Tensor, rows: torch.Tensor, kv_b: torch.Tensor,
    kv_lora_rank: int, v_head_dim: int, scale: float, start: int,
) -> torch.Tensor:
    """One sequence. q_* [q, H, d]; rows [ctx, row]; query j sits at position start + j.

    Returns o [q, H, v_head_dim] in fp32. Queries go in chunks whose scores fit SCORES_BYTES; each
    query's softmax is its own, so the chunks give what one pass would.
    """
    nq, h, dn = q_nope.shape
    c, k_r = rows[:, :kv_lora_rank].float(), rows[:, kv_lora_rank:].float()
    kv = (c @ kv_b.float().t()).view(-1, h, dn + v_head_dim)
    k_n, v = kv[..., :dn], kv[..., dn:]
    step = max(1, SCORES_BYTES // (4 * h * rows.shape[0]))
    if nq <= step:
        return _attend(q_nope, q_rope, k_n, k_r, v, scale, start)
    return torch.cat([_attend(q_nope[i:i + step], q_rope[i:i + step], k_n, k_r, v, scale, start + i)
                      for i in range(0, nq, step)])


def _attend(q_nope, q_rope, k_n, k_r, v, scale: float, start: int) -> torch.Tensor:
    scores = torch.einsum("qhd,shd->hqs", q_nope.float(), k_n) + torch.einsum("qhd,sd->hqs", q_rope.float(), k_r)
    qpos = start + torch.arange(q_nope.shape[0], device=k_n.device)
    mask = torch.arange(k_n.shape[0], device=k_n.device)[None, :] > qpos[:, None]
    p = torch.softmax((scores * scale).masked_fill(mask, float("-inf")), -1)
    return torch.einsum("hqs,shd->qhd", p, v)


def mla_absorbed_decode(
    q_nope: torch.Tensor, q_rope: torch.Tensor, pages: torch.Tensor, layer: int, block_tables: torch.Tensor,
    context_lens: torch.Tensor, kv_b: torch.Tensor, kv_lora_rank: int, v_head_dim: int, scale: float,
) -> torch.Tensor:
    """One query token per sequence, batched. q_* [N, H, d]; block_tables [N, B]; context_lens [N].

    Returns o [N, H, v_head_dim] in fp32.
    """
    n, h, dn = q_nope.shape
    bs = pages.shape[2]
    w = kv_b.float().view(h, dn + v_head_dim, kv_lora_rank)
    w_uk, w_uv = w[:, :dn], w[:, dn:]
    q_lat = torch.einsum("nhd,hdr->nhr", q_nope.float(), w_uk)
    q_full = torch.cat([q_lat, q_rope.float()], -1)  # [N, H, R + d_r]
    ctx_max = int(context_lens.max())
    pos = torch.arange(ctx_max, device=pages.device)
    blocks = block_tables[:, pos // bs].clamp_min(0)
    rows = pages[blocks, layer, (pos % bs).expand_as(blocks)].float()  # [N, S, row]
    scores = torch.einsum("nhr,nsr->nhs", q_full, rows) * scale
    scores = scores.masked_fill((pos[None, :] >= context_lens[:, None])[:, None, :], float("-inf"))
    p = torch.softmax(scores, -1)
    o_lat = torch.einsum("nhs,nsr->nhr", p, rows[..., :kv_lora_rank])
    return torch.einsum("nhr,hvr->nhv", o_lat, w_uv)


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                       scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of q [..., L, d] over k [..., S, d], v [..., S, d_v] in fp32, with the natural
    log-sum-exp of each query's scaled scores: (o [..., L, d_v], lse [..., L]). `causal`: query i sees
    keys 0..i (the top-left mask, as SDPA's is_causal). No key at all gives lse = -inf and o = 0, which
    a log-sum-exp merge weighs as nothing."""
    scores = (q.float() @ k.float().transpose(-1, -2)) * scale
    if causal:
        above = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(above, float("-inf"))
    lse = torch.logsumexp(scores, -1)
    p = torch.exp(scores - lse[..., None])
    return p @ v.float(), lse
