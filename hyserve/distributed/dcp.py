"""Decode context parallelism for MLA: the latent cache split by token over a DCP group of W ranks.

Token ownership is interleaved: global position p lives on rank (p // I) % W at local position
(p // (I W)) I + p % I, I = `cp_kv_cache_interleave_size`. A rank's block i of a sequence holds its
local positions [i B, (i + 1) B), so one block table serves every rank and the scheduler counts blocks
of B W tokens. Attention: the absorbed query (576 values a head) of every rank's heads is all-gathered,
each rank attends over its own tokens, returning the output and the natural-log LSE, and the partial
outputs are weighted by exp(lse_r - logsumexp_r lse_r) and reduce-scattered back to each rank's heads.
A rank that owns none of a row's tokens has lse = -inf and contributes exactly zero (never NaN).
Causality is by global position, so multi-token rows (verify, chunked prefill) are exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hyserve.distributed.comm import Group
from hyserve.models.batch import Batch


@dataclass(frozen=True)
class TokenOwnership:
    world: int
    rank: int
    interleave: int = 1

    def owner(self, pos: torch.Tensor) -> torch.Tensor:
        return (pos // self.interleave) % self.world

    def local_pos(self, pos: torch.Tensor) -> torch.Tensor:
        i = self.interleave
        return (pos // (i * self.world)) * i + pos % i

    def global_pos(self, local: torch.Tensor) -> torch.Tensor:
        i = self.interleave
        return (local // i) * i * self.world + self.rank * i + local % i

    def local_len(self, n: int) -> int:
        """How many of positions 0..n-1 this rank owns."""
        i, cycle = self.interleave, self.interleave * self.world
        return (n // cycle) * i + min(i, max(0, n % cycle - self.rank * i))

    def slot_mapping(self, batch: Batch, block_size: int) -> torch.Tensor:
        """Each new token's slot in this rank's pages, -1 where another rank owns it."""
        seq = torch.repeat_interleave(torch.arange(batch.num_seqs, device=batch.positions.device),
                                      torch.as_tensor(batch.query_lens, device=batch.positions.device))
        lp = self.local_pos(batch.positions)
        slots = batch.block_tables[seq, lp // block_size] * block_size + lp % block_size
        return torch.where(self.owner(batch.positions) == self.rank, slots, -1)


def write_owned(pages: torch.Tensor, layer: int, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """Store the rows of the tokens this rank owns (slot >= 0) in its pages."""
    mine = slots >= 0
    s = slots[mine]
    pages[s // pages.shape[2], layer, s % pages.shape[2]] = rows[mine].to(pages.dtype)


def local_rows(pages: torch.Tensor, layer: int, block_table: torch.Tensor, n: int) -> torch.Tensor:
    """A sequence's first n local rows on this rank [n, row]."""
    lp = torch.arange(n, device=pages.device)
    return pages[block_table[lp // pages.shape[2]], layer, lp % pages.shape[2]]


def partial_attention(
    q: torch.Tensor, rows: torch.Tensor, row_pos: torch.Tensor, q_pos: torch.Tensor, kv_lora_rank: int, scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed MLA of query rows q [n, H, R + d_r] over rows [S, R + d_r] at global positions row_pos [S],
    row t seeing the positions <= q_pos[t]. Returns (o [n, H, R], lse [n, H]) in fp32 (fp64 inputs stay
    fp64); a row that sees nothing has o = 0 and lse = -inf."""
    dt = torch.float64 if q.dtype == torch.float64 else torch.float32
    r = rows.to(dt)
    scores = torch.einsum("nhr,sr->nhs", q.to(dt), r) * scale
    p, lse = softmax_lse(scores.masked_fill((row_pos[None, :] > q_pos[:, None])[:, None, :], float("-inf")))
    return torch.einsum("nhs,sr->nhr", p, r[:, :kv_lora_rank]), lse


def softmax_lse(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(softmax over the last dim, its natural-log LSE); a row of only -inf gives zeros and lse = -inf."""
    lse = torch.logsumexp(scores, -1)
    return torch.exp(scores - lse.masked_fill(torch.isinf(lse), 0)[..., None]), lse


def combine(o: torch.Tensor, lse: torch.Tensor, group: Group) -> torch.Tensor:
    """Partial outputs o [T, H_all, R] with lse [T, H_all] of every rank of `group` -> the exact output of
    this rank's heads [T, H_all / W, R] (heads in rank order): all-gather the LSEs, weight, reduce-scatter."""
    lses = group.all_gather(lse[None], dim=0)  # [W, T, H_all]
    g = torch.logsumexp(lses, 0)
    factor = torch.exp(lse - g.masked_fill(torch.isinf(g), 0))
    # an empty shard's factor is exactly 0; where() keeps a non-finite partial out of the sum
    weighted = torch.where((factor == 0)[..., None], 0.0, o * factor[..., None])
    return group.reduce_scatter(weighted, dim=1)


def absorb(q_nope: torch.Tensor, q_rope: torch.Tensor, kv_b: torch.Tensor, kv_lora_rank: int, v_head_dim: int) -> torch.Tensor:
    """The 576-value query [T, H, R + d_r] of this rank's heads (kv_b: their [H (d_n + d_v), R] rows)."""
    h, dn = q_nope.shape[1], q_nope.shape[2]
    w_uk = kv_b.view(h, dn + v_head_dim, kv_lora_rank)[:, :dn]
    dt = torch.float64 if q_nope.dtype == torch.float64 else torch.float32
    q_lat = torch.einsum("thd,hdr->thr", q_nope.to(dt), w_uk.to(dt))
    return torch.cat([q_lat, q_rope.to(dt)], -1)


def up_project(o_lat: torch.Tensor, kv_b: torch.Tensor, v_head_dim: int) -> torch.Tensor:
    """o [T, H, R] in latent space -> [T, H, d_v] through this rank's heads' W_UV."""
    h, r = o_lat.shape[1], o_lat.shape[2]
    w_uv = kv_b.view(h, -1, r)[:, -v_head_dim:]
    return torch.einsum("thr,hvr->thv", o_lat, w_uv.to(o_lat.dtype))


def dcp_mla(
    q_nope: torch.Tensor, q_rope: torch.Tensor, kv_b: torch.Tensor, pages: torch.Tensor, layer: int, batch: Batch,
    own: TokenOwnership, group: Group, kv_lora_rank: int, v_head_dim: int, scale: float,
) -> torch.Tensor:
    """Attention output [T, H, d_v] of this rank's heads over the group's split cache (rows already
    written). q_*: [T, H, d] of this rank's heads."""
    q = group.all_gather(absorb(q_nope, q_rope, kv_b, kv_lora_rank, v_head_dim), dim=1)  # [T, H W, 576]
    t, h_all = q.shape[0], q.shape[1]
    o = q.new_zeros(t, h_all, kv_lora_rank)
    lse = q.new_full((t, h_all), float("-inf"))
    cu = batch.cu_seqlens.tolist()
    for i, ctx in enumerate(batch.context_lens):
        sl = slice(cu[i], cu[i + 1])
        n = own.local_len(ctx)
        rows = local_rows(pages, layer, batch.block_tables[i], n)
        pos = own.global_pos(torch.arange(n, device=q.device))
        o[sl], lse[sl] = partial_attention(q[sl], rows, pos, batch.positions[sl], kv_lora_rank, scale)
    return up_project(combine(o, lse, group), kv_b, v_head_dim)
