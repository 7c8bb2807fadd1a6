"""The DSA indexer's top-k under DCP: each rank scores only the index keys of the tokens it owns, and the
global top-k is merged exactly (the compact design of the reference deployment):

1. each rank orders its candidates by (score descending, global position ascending) - one total order on
   every rank, so ties cannot make ranks (or runs) pick different sets - and sends its best
   c = ceil(1.5 k / W) of them (fewer if it has fewer);
2. every rank merges the W sent lists the same way and keeps the best k;
3. a rank whose whole sent list survived and that holds more candidates might hold more of the top k:
   it resends its full local top-k for that row and the row is merged again (every rank knows which rows,
   from the gathered data, so no extra round decides it).

The global top-k is within the union of the local top-k's, and when a rank's c-th candidate did not make
the cut none of its unsent (worse) ones can: the result equals the single-device top-k exactly.
"""

from __future__ import annotations

import math

import torch

from hyserve.distributed.comm import Group
from hyserve.distributed.dcp import TokenOwnership, absorb, combine, softmax_lse, up_project
from hyserve.models.layers.dsa import token_seq_ids
from hyserve.ops import dsa_indexer as dsa


def order_candidates(scores: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of (score, global position) sorted by score descending then position ascending; invalid
    entries (pos < 0) last."""
    scores = scores.float().masked_fill(pos < 0, float("-inf"))
    by_pos = torch.sort(torch.where(pos < 0, torch.iinfo(torch.long).max, pos), dim=-1, stable=True).indices
    s, p = scores.gather(-1, by_pos), pos.gather(-1, by_pos)
    by_score = torch.sort(s, dim=-1, descending=True, stable=True).indices
    return s.gather(-1, by_score), p.gather(-1, by_score)


def _gather_lists(scores: torch.Tensor, pos: torch.Tensor, group: Group) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's [T, c] lists side by side [T, W c] (rank-major), as fp64 pairs: fp32 scores and
    positions below 2^53 both exact."""
    packed = torch.stack([scores.double(), pos.double()], -1)  # [T, c, 2]
    allp = group.all_gather(packed[None], dim=0)  # [W, T, c, 2]
    allp = allp.permute(1, 0, 2, 3).reshape(scores.shape[0], -1, 2)
    return allp[..., 0].float(), allp[..., 1].long()


def merge_topk(
    scores: torch.Tensor, pos: torch.Tensor, k: int, group: Group, send: int | None = None,
) -> tuple[torch.Tensor, int]:
    """This rank's candidates scores [T, C] at global positions pos [T, C] (-1: none) -> (the global top-k
    positions [T, k], best first, -1 padded; how many rows needed the resend round)."""
    s, p = order_candidates(scores, pos)
    if s.shape[1] < k:  # every rank sends lists of the same width
        s = torch.cat([s, s.new_full((s.shape[0], k - s.shape[1]), float("-inf"))], 1)
        p = torch.cat([p, p.new_full((p.shape[0], k - p.shape[1]), -1)], 1)
    s, p = s[:, :k], p[:, :k]
    c = min(k, max(math.ceil(k / group.size), send if send is not None else math.ceil(1.5 * k / group.size)))
    held = group.all_gather((p >= 0).sum(-1)[None], dim=0)  # [W, T]: candidates (up to k) each rank holds
    all_s, all_p = _gather_lists(s[:, :c], p[:, :c], group)
    top = order_candidates(all_s, all_p)[1][:, :k]
    # rank r's c-th candidate made the cut and r holds more: r may hold more of the top k
    last = all_p.view(-1, group.size, c)[:, :, -1]
    survived = (last[:, :, None] == top[:, None, :]).any(-1) & (last >= 0)
    rows = (survived & (held.t() > c)).any(-1).nonzero().flatten()
    if rows.numel():  # every rank computed the same rows
        rs, rp = _gather_lists(s[rows], p[rows], group)
        top = top.clone()
        top[rows] = order_candidates(rs, rp)[1][:, :k]
    return top, int(rows.numel())


def dcp_index_topk(indexer, x: torch.Tensor, q_lat: torch.Tensor, batch, cache, own: TokenOwnership, slots: torch.Tensor,
                   group: Group) -> torch.Tensor:
    """The DSA indexer of one MLA layer under DCP: store the index keys of the tokens this rank owns,
    score the step's rows against this rank's keys, merge the top-k over the group. Returns the selected
    global positions [T, min(k, longest context)] (-1 padded), the same set as `Indexer.forward`."""
    q, k, w = indexer.project(x, q_lat, None)
    pool, fmt, layer, bs = cache.index_keys, indexer.fmt, indexer.mla_index, cache.block_size
    mine = slots >= 0
    dsa.write_key_records(pool, fmt, layer, slots[mine], dsa.encode_keys(k, fmt, indexer.ue8m0)[mine])
    lens = [own.local_len(c) for c in batch.context_lens]
    scores = x.new_full((x.shape[0], max(lens)), float("-inf"), dtype=torch.float32)
    pos = torch.full(scores.shape, -1, dtype=torch.long, device=x.device)
    cu = batch.cu_seqlens.tolist()
    for i, n in enumerate(lens):
        sl, lp = slice(cu[i], cu[i + 1]), torch.arange(n, device=x.device)
        stored = dsa.gather_key_records(pool, fmt, layer, batch.block_tables[i, lp // bs], lp % bs)
        gp = own.global_pos(lp)
        scores[sl, :n] = indexer.scores(q[sl], w[sl], stored, k.dtype)
        pos[sl, :n] = torch.where(gp[None, :] <= batch.positions[sl, None], gp[None, :], -1)
    top, _ = merge_topk(scores, pos, indexer.topk, group)
    return top[:, : min(indexer.topk, max(batch.context_lens))]


def dcp_sparse_mla(q_nope: torch.Tensor, q_rope: torch.Tensor, kv_b: torch.Tensor, pages: torch.Tensor, layer: int,
                   batch, selected: torch.Tensor, own: TokenOwnership, group: Group, kv_lora_rank: int,
                   v_head_dim: int, scale: float) -> torch.Tensor:
    """Sparse absorbed MLA [T, H, d_v] of this rank's heads over the selected global positions: each rank
    attends over the selected positions it owns (compacted to the front of each row), then LSE combine."""
    q = group.all_gather(absorb(q_nope, q_rope, kv_b, kv_lora_rank, v_head_dim), dim=1)
    owned = (selected >= 0) & (own.owner(selected.clamp_min(0)) == own.rank)
    order = torch.sort((~owned).to(torch.int8), dim=-1, stable=True).indices  # owned first, in selection order
    sel, valid = selected.gather(1, order), owned.gather(1, order)
    lp = own.local_pos(sel.clamp_min(0))
    bs = pages.shape[2]
    tables = batch.block_tables[token_seq_ids(batch).long()]
    rows = pages[tables.gather(1, lp // bs), layer, lp % bs].to(q.dtype)  # [T, k, R + d_r]
    scores = torch.einsum("thr,tkr->thk", q, rows) * scale
    p, lse = softmax_lse(scores.masked_fill(~valid[:, None, :], float("-inf")))
    o = torch.einsum("thk,tkr->thr", p, rows[..., :kv_lora_rank])
    return up_project(combine(o, lse, group), kv_b, v_head_dim)
