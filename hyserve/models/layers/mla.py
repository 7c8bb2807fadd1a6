"""MLA without position encoding (Kimi Linear), K3's gated MLA with q-LoRA, and with a DSA indexer (K3.1,
DeepSeek V3.2, which also rotates the rope slice) sparse absorbed MLA (docs/ARCHITECTURE.md §4.3, §4.4)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hyserve.models.batch import Batch, CacheTensors, to_device
from hyserve.models.config import ModelConfig
from hyserve.models.layers.dsa import Indexer, sparse_mla, token_seq_ids
from hyserve.models.layers.merged import merged
from hyserve.models.layers.norm import RMSNorm
from hyserve.models.layers.rope import Rotary
from hyserve.ops import mla_attention as mla_ops
from hyserve.ops.dense_gemv import linear
from hyserve.ops.kernel_plan import REFERENCE, KernelPlan, active
from hyserve.ops.mla_cache import write_cache_rows

# q_a_layernorm / kv_a_layernorm use the class default eps, not rms_norm_eps (docs/ARCHITECTURE.md §4.1).
_LATENT_NORM_EPS = 1e-6


def _linear(i: int, o: int) -> nn.Linear:
    return nn.Linear(i, o, bias=False)


class MLAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, mla_index: int):
        super().__init__()
        d, h = cfg.hidden_size, cfg.num_attention_heads
        self.mla_index, self.num_heads = mla_index, h
        self.dn, self.dr, self.dv, self.rank = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        self.scale = cfg.attn_softmax_scale
        if cfg.q_lora_rank:
            self.q_a_proj = _linear(d, cfg.q_lora_rank)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, _LATENT_NORM_EPS)
            self.q_b_proj = _linear(cfg.q_lora_rank, h * cfg.qk_head_dim)
        else:
            self.q_proj = _linear(d, h * cfg.qk_head_dim)
        self.kv_a_proj_with_mqa = _linear(d, self.rank + self.dr)
        self.kv_a_layernorm = RMSNorm(self.rank, _LATENT_NORM_EPS)
        self.kv_b_proj = _linear(self.rank, h * (self.dn + self.dv))
        if cfg.mla_output_gate:
            self.g_proj = _linear(d, h * self.dv)
        self.o_proj = _linear(h * self.dv, d)
        self.rotary = (
            Rotary(self.dr, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings) if cfg.use_rope else None
        )
        self.indexer = Indexer(cfg, mla_index) if cfg.has_indexer else None

    def query(self, x: torch.Tensor, q_lat: torch.Tensor | None = None) -> torch.Tensor:
        if hasattr(self, "q_proj"):
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)) if q_lat is None else q_lat)
        return q.view(x.shape[0], self.num_heads, self.dn + self.dr)

    def cache_rows(self, x: torch.Tensor) -> torch.Tensor:
        ckv = self.kv_a_proj_with_mqa(x)
        return torch.cat([self.kv_a_layernorm(ckv[:, : self.rank]), ckv[:, self.rank :]], -1)

    def forward(self, x: torch.Tensor, batch: Batch, cache: CacheTensors, plan: KernelPlan | None = None) -> torch.Tensor:
        plan = active(plan)
        if plan.training and self.indexer is None and uniform_rows(batch) is not None:
            return self.train_forward(x, batch, plan)
        t = x.shape[0]
        path = plan.mla_path(cache.pages.dtype, x.dtype)
        if path == "merged" and self.indexer is None:
            q, ckv = self._project_fast(x)
            norm = self.kv_a_layernorm
            write_cache_rows(ckv, norm.weight, norm.eps, cache.pages, self.mla_index, batch.slot_mapping)
            o = self._attend_fast(q[..., : self.dn], q[..., self.dn :], batch, cache, plan)
            return self.project_out(o, x, plan)
        # the indexer reads the MLA query latent, so compute it once
        q_lat = self.q_a_layernorm(self.q_a_proj(x)) if self.indexer is not None else None
        q = self.query(x, q_lat)
        q_nope, q_rope = q[..., : self.dn], q[..., self.dn :]
        rows, cos_sin = self.cache_rows(x), None
        if self.rotary is not None:  # the rope slices of q and of the shared key, cached rotated
            cos_sin = self.rotary.cos_sin(batch.positions)
            q_rope = Rotary.apply(q_rope, *cos_sin)
            rows = torch.cat([rows[:, : self.rank], Rotary.apply(rows[:, self.rank :], *cos_sin)], -1)
        pages, layer, bs = cache.pages, self.mla_index, cache.block_size
        pages[batch.slot_mapping // bs, layer, batch.slot_mapping % bs] = rows.to(pages.dtype)
        if self.indexer is not None:
            selected = self.indexer(x, q_lat, batch, cache, cos_sin, plan)
            if plan.dsa_sparse_mla == "triton":
                from hyserve.ops.sparse_mla_triton import sparse_mla_fast

                o = sparse_mla_fast(
                    q_nope, q_rope, pages, layer, batch.block_tables, token_seq_ids(batch), selected,
                    self.kv_b_proj.weight, self.rank, self.dv, self.scale,
                )
                return self.project_out(o, x, plan)
            o = sparse_mla(
                q_nope, q_rope, pages, layer, batch.block_tables, selected,
                self.kv_b_proj.weight, self.rank, self.dv, self.scale, token_seq=token_seq_ids(batch),
            )
            return self.project_out(o, x, plan)
        if path != REFERENCE:
            return self.project_out(self._attend_fast(q_nope, q_rope, batch, cache, plan), x, plan)

        o = torch.empty(t, self.num_heads, self.dv, dtype=torch.float32, device=x.device)
        qlens, ctx = batch.query_lens, batch.context_lens
        decode = [i for i, n in enumerate(qlens) if n == 1]
        if decode:
            idx = to_device(decode, torch.long, x.device)
            tok = batch.cu_seqlens[idx]
            ctx_t = to_device([ctx[i] for i in decode], torch.long, x.device)
            o[tok] = mla_ops.mla_absorbed_decode(
                q_nope[tok], q_rope[tok], pages, layer, batch.block_tables[idx], ctx_t,
                self.kv_b_proj.weight, self.rank, self.dv, self.scale,
            )
        cu = batch.cu_seqlens_host
        for i, n in enumerate(qlens):
            if n > 1:
                sl = slice(cu[i], cu[i + 1])
                rows = mla_ops.gather_rows(pages, layer, batch.block_tables[i], ctx[i])
                o[sl] = mla_ops.mla_expanded(
                    q_nope[sl], q_rope[sl], rows, self.kv_b_proj.weight, self.rank, self.dv, self.scale, ctx[i] - n
                )
        return self.project_out(o, x, plan)

    def train_forward(self, x: torch.Tensor, batch: Batch, plan: KernelPlan) -> torch.Tensor:
        """The training plan's MLA over equal-length fresh rows: one causal SDPA over [rows, heads, row_len,
        dim] (flash attention on the GPU) in the expanded form the reference prefill computes, instead of
        one call per sequence over the paged cache; no cache row is written."""
        row_len = uniform_rows(batch)
        t, h, dn, dv, rank = x.shape[0], self.num_heads, self.dn, self.dv, self.rank
        q = self.query(x)
        rows = self.cache_rows(x)  # [T, rank + dr]: normed latent | shared rope key
        q_nope, q_rope, k_rope = q[..., :dn], q[..., dn:], rows[:, rank:]
        if self.rotary is not None:
            cos, sin = self.rotary.cos_sin(batch.positions)
            q_rope, k_rope = Rotary.apply(q_rope, cos, sin), Rotary.apply(k_rope, cos, sin)
        kv = self.kv_b_proj(rows[:, :rank]).view(t, h, dn + dv)
        k = torch.cat([kv[..., :dn], k_rope[:, None, :].to(kv.dtype).expand(-1, h, -1)], -1)
        q = torch.cat([q_nope, q_rope], -1).to(k.dtype)
        v = F.pad(kv[..., dn:], (0, k.shape[-1] - dv))  # the flash kernel wants v as wide as q and k

        def heads_first(z: torch.Tensor) -> torch.Tensor:  # [T, H, d] -> [rows, H, row_len, d]
            return z.view(t // row_len, row_len, h, -1).transpose(1, 2)

        o = F.scaled_dot_product_attention(heads_first(q), heads_first(k), heads_first(v), is_causal=True,
                                           scale=self.scale)
        return self.project_out(o.transpose(1, 2)[..., :dv].reshape(t, h, dv), x, plan)

    def _project_fast(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(q [T, H, d_n + d_r], the kv_a output [T, R + d_r]) from one GEMM over q (or q_a) | kv_a."""
        first = self.q_proj.weight if hasattr(self, "q_proj") else self.q_a_proj.weight
        y = F.linear(x, merged(self, "_merged_q_kv", [first, self.kv_a_proj_with_mqa.weight]))
        q, ckv = y.split([first.shape[0], self.rank + self.dr], -1)
        if not hasattr(self, "q_proj"):
            q = self.q_b_proj(self.q_a_layernorm(q))
        return q.view(x.shape[0], self.num_heads, self.dn + self.dr), ckv

    def _attend_fast(self, q_nope, q_rope, batch: Batch, cache: CacheTensors, plan: KernelPlan) -> torch.Tensor:
        """Triton absorbed decode for one-token sequences and for the tokens of verify rows (`DecodeRows`),
        flash SDPA on expanded K/V for prefill chunks."""
        from hyserve.ops.mla_decode import mla_absorbed_decode_fast, mla_prefill_fast

        t, dev = q_nope.shape[0], q_nope.device
        w, layout, pages = self.kv_b_proj.weight, plan.mla_decode_layout, cache.pages
        if batch.decode_only and t:  # the graph-captured case: the step's own tensors, nothing built
            return mla_absorbed_decode_fast(
                q_nope, q_rope, pages, self.mla_index, batch.block_tables, batch.context_lens_device,
                max(batch.context_lens), w, self.rank, self.dv, self.scale, layout,
            )
        rows = batch.decode_rows
        if rows is not None:
            qn, qr = (q_nope, q_rope) if rows.whole_step else (q_nope[rows.tokens], q_rope[rows.tokens])
            d = mla_absorbed_decode_fast(
                qn, qr, pages, self.mla_index, batch.block_tables[rows.seqs], rows.context_lens, rows.max_context,
                w, self.rank, self.dv, self.scale, layout,
            )
            if rows.whole_step:
                return d
        o = torch.empty(t, self.num_heads, self.dv, dtype=q_nope.dtype, device=dev)
        if rows is not None:
            o[rows.tokens] = d
        pre = batch.prefill_rows
        if pre is None:
            return o
        tok = pre.tokens
        o[tok] = mla_prefill_fast(
            q_nope[tok], q_rope[tok], pages, self.mla_index, None, [batch.query_lens[i] for i in pre.seqs],
            pre.context_lens, w, self.rank, self.dv, self.scale,
            context_rows=pre.context_rows(batch.block_tables, pages.shape[2]),
        )
        return o

    def project_out(self, o: torch.Tensor, x: torch.Tensor, plan: KernelPlan) -> torch.Tensor:
        out = o.to(x.dtype).reshape(x.shape[0], self.num_heads * self.dv)
        if hasattr(self, "g_proj"):
            out = out * torch.sigmoid(self.g_proj(x))
        return linear(out, self.o_proj.weight, config=plan.linear_gemv(out, self.o_proj.weight))


def uniform_rows(batch: Batch) -> int | None:
    """The row length when every sequence is a fresh row of the same length (a training step), else None."""
    n = batch.query_lens[0] if batch.query_lens else 0
    same = all(q == n for q in batch.query_lens) and batch.context_lens == batch.query_lens
    return n if same and n > 0 else None
