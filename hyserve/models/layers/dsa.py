"""DSA indexer (K3.1, DeepSeek V3.2) and the sparse MLA it drives (docs/ARCHITECTURE.md §4.4).

Per MLA layer the indexer projects a small multi-head query from the MLA query latent and one key per
token from the layer input, stores each new token's key in the cache beside the MLA latent, and picks
for every query row the top-k earlier positions by index score. K3.1 has no rotary; V3.2 rotates the
first `qk_rope_head_dim` dims (half-split) and, on its FP8 path, applies a Walsh-Hadamard transform and
power-of-two (ue8m0) scales before quantising.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hyserve.models.batch import Batch, CacheTensors, to_device
from hyserve.models.config import ModelConfig
from hyserve.models.layers.rope import Rotary
from hyserve.ops import dsa_indexer as dsa
from hyserve.ops.kernel_plan import KernelPlan, active
from hyserve.ops.sparse_mla import sparse_mla

_K_NORM_EPS = 1e-6


class IndexKeyNorm(nn.Module):
    """LayerNorm with weight and bias; statistics in fp32, output in the input dtype (docs/ARCHITECTURE.md §4.1)."""

    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.layer_norm(x.float(), (x.shape[-1],), self.weight.float(), self.bias.float(), _K_NORM_EPS)
        return y.to(x.dtype)


class Indexer(nn.Module):
    def __init__(self, cfg: ModelConfig, mla_index: int):
        super().__init__()
        d, self.n_heads, self.head_dim = cfg.hidden_size, int(cfg.index_n_heads), int(cfg.index_head_dim)
        self.mla_index, self.topk, self.fmt = mla_index, int(cfg.index_topk), cfg.index_key_format
        self.wq_b = nn.Linear(int(cfg.q_lora_rank), self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(d, self.head_dim, bias=False)
        self.k_norm = IndexKeyNorm(self.head_dim)
        self.weights_proj = nn.Linear(d, self.n_heads, bias=False)  # held and applied in fp32
        self.rope_dim = cfg.qk_rope_head_dim if cfg.use_rope else 0
        # DeepSeek's deployed FP8 numerics (docs/ARCHITECTURE.md §4.4); K3.1 uses plain fp32 scales and no rotation
        self.ue8m0 = cfg.is_deepseek_v32
        self.hadamard = cfg.is_deepseek_v32 and self.fmt == "fp8"

    def project(
        self, x: torch.Tensor, q_lat: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor] | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(qI [T, H, D], kI [T, D] in the model dtype, w [T, H] fp32 including H^-1/2)."""
        t = x.shape[0]
        q = self.wq_b(q_lat).view(t, self.n_heads, self.head_dim)
        k = self.k_norm(self.wk(x))
        if self.rope_dim:  # rope dims come FIRST in the indexer (opposite of MLA)
            r = self.rope_dim
            cos, sin = cos_sin
            q = torch.cat([Rotary.apply(q[..., :r], cos, sin), q[..., r:]], -1)
            k = torch.cat([Rotary.apply(k[..., :r], cos, sin), k[..., r:]], -1)
        w = F.linear(x.float(), self.weights_proj.weight.float()) * self.n_heads**-0.5
        return q, k, w

    def forward(
        self, x: torch.Tensor, q_lat: torch.Tensor, batch: Batch, cache: CacheTensors,
        cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None, plan: KernelPlan | None = None,
    ) -> torch.Tensor:
        """Write the step's index keys; return the selected positions [T, k] (long, -1 = none)."""
        q, k, w = self.project(x, q_lat, cos_sin)
        if self.hadamard:
            q, k = dsa.hadamard(q).to(q.dtype), dsa.hadamard(k).to(k.dtype)
        keys, layer, bs = cache.index_keys, self.mla_index, cache.block_size
        dsa.write_key_records(keys, self.fmt, layer, batch.slot_mapping, dsa.encode_keys(k, self.fmt, self.ue8m0))

        plan = active(plan)
        if plan.dsa_index_kernel(max(batch.context_lens)) == "triton":
            from hyserve.ops.dsa_index_triton import index_topk_fast

            return index_topk_fast(
                q, w, keys, layer, self.fmt, batch.block_tables, batch.query_lens, batch.context_lens,
                batch.positions, self.topk, self.ue8m0, fp8_dot=plan.dsa_fp8_dot,
            )
        width = min(self.topk, max(batch.context_lens))
        out = torch.full((x.shape[0], width), -1, dtype=torch.long, device=x.device)
        cu = batch.cu_seqlens_host
        for i, (n, ctx) in enumerate(zip(batch.query_lens, batch.context_lens)):
            sl = slice(cu[i], cu[i + 1])
            qpos = batch.positions[sl]
            if ctx <= self.topk:
                # every causal position is selected: skip scoring (the keys above are still written)
                sel = torch.arange(ctx, device=x.device).expand(n, ctx)
                out[sl, :ctx] = torch.where(sel > qpos[:, None], -1, sel)
                continue
            pos = torch.arange(ctx, device=x.device)
            stored = dsa.gather_key_records(keys, self.fmt, layer, batch.block_tables[i, pos // bs], pos % bs)
            # row chunks bound the [rows, ctx] scores and their sort, and a chunk scores only the keys
            # up to its last row's position (causal: the rest could not be selected)
            step = max(1, dsa.WORKSPACE_BYTES // (24 * ctx))
            for a in range(0, n, step):
                b = min(n, a + step)
                hi = min(ctx, int(qpos[a:b].max()) + 1)
                rows = slice(cu[i] + a, cu[i] + b)
                sel = dsa.topk_causal(self.scores(q[rows], w[rows], stored[:hi], k.dtype), qpos[a:b], self.topk)
                out[rows, : sel.shape[1]] = sel
        return out

    def scores(self, q: torch.Tensor, w: torch.Tensor, stored: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """I[t, s] for one sequence's query rows against its stored key records (R0 for "raw", else R1)."""
        if self.fmt == "raw":
            return dsa.index_scores_r0(q, w, stored.contiguous().view(dtype))
        q8, w_folded = dsa.quantize_queries(q, w, self.ue8m0)
        if self.fmt == "fp8":
            k8, k_scale = dsa.split_fp8_keys(stored)
            return dsa.index_scores_q(q8, w_folded, k8, k_scale)
        return dsa.index_scores_q(q8, w_folded, dsa.dequantize_mxfp4_keys(stored), None)


def token_seq_ids(batch: Batch) -> torch.Tensor:
    """Each token's sequence index [T] (int32; the GPU kernels read block tables per sequence)."""
    dev = batch.block_tables.device
    if batch.decode_only:  # one row per sequence: no host-to-device copy
        return torch.arange(batch.num_seqs, device=dev, dtype=torch.int32)
    q = to_device(batch.query_lens, torch.long, dev)
    return torch.repeat_interleave(torch.arange(batch.num_seqs, device=dev, dtype=torch.int32), q,
                                   output_size=batch.num_tokens)  # a known size: no sync


__all__ = ["Indexer", "IndexKeyNorm", "sparse_mla", "token_seq_ids"]
