"""Sparse absorbed MLA over the paged latent cache (docs/ARCHITECTURE.md §4.4), torch reference.

Every query row attends only to the cache rows its index list names: MQA with a 576-dim query
[q_lat | q_r] against the gathered 576-dim rows, the value being the rows' first R dims. Prefill and
decode share this one form (as FlashMLA's sparse kernels do). Index lists hold request-local positions
padded with -1; with every causal position listed it equals dense causal attention.
"""

from __future__ import annotations

import torch

# The gathered rows are [rows, k, 576] fp32 (4.7 MB per query row at k = 2048): a long prefill is taken
# in row chunks whose temporaries stay under this many bytes instead of gathering all of them at once.
WORKSPACE_BYTES = 1 << 30


def sparse_mla(
    q_nope: torch.Tensor, q_rope: torch.Tensor, pages: torch.Tensor, layer: int, block_tables: torch.Tensor,
    indices: torch.Tensor, kv_b: torch.Tensor, kv_lora_rank: int, v_head_dim: int, scale: float,
    token_seq: torch.Tensor | None = None,
) -> torch.Tensor:
    """q_* [T, H, d]; indices [T, k] long (-1 = none); block_tables [T, B], each token's sequence's table,
    or [num_seqs, B] with `token_seq` [T] naming each token's sequence.

    Returns o [T, H, v_head_dim] in fp32. Logits, softmax and accumulation are fp32.
    """
    t, h, dn = q_nope.shape
    k, width = indices.shape[1], pages.shape[-1]
    w = kv_b.float().view(h, dn + v_head_dim, kv_lora_rank)
    per_row = 4 * (k * width + 2 * h * k + h * (width + kv_lora_rank + v_head_dim))
    step = max(1, WORKSPACE_BYTES // per_row)
    out = torch.empty(t, h, v_head_dim, dtype=torch.float32, device=q_nope.device)
    for a in range(0, t, step):
        rows = slice(a, min(t, a + step))
        tables = block_tables[rows] if token_seq is None else block_tables[token_seq[rows].long()]
        out[rows] = _attend(q_nope[rows], q_rope[rows], pages, layer, tables, indices[rows], w, kv_lora_rank, scale)
    return out


def _attend(
    q_nope: torch.Tensor, q_rope: torch.Tensor, pages: torch.Tensor, layer: int, block_tables: torch.Tensor,
    indices: torch.Tensor, w: torch.Tensor, kv_lora_rank: int, scale: float,
) -> torch.Tensor:
    bs = pages.shape[2]
    dn = q_nope.shape[-1]
    w_uk, w_uv = w[:, :dn], w[:, dn:]
    q_lat = torch.einsum("thd,hdr->thr", q_nope.float(), w_uk)
    q_full = torch.cat([q_lat, q_rope.float()], -1)  # [T, H, R + d_r]
    valid = indices >= 0
    pos = indices.clamp_min(0)
    blocks = block_tables.gather(1, pos // bs)
    rows = pages[blocks, layer, pos % bs].float()  # [T, k, R + d_r]
    scores = torch.einsum("thr,tkr->thk", q_full, rows) * scale
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    p = torch.softmax(scores, -1)
    o_lat = torch.einsum("thk,tkr->thr", p, rows[..., :kv_lora_rank])
    return torch.einsum("thr,hvr->thv", o_lat, w_uv)
