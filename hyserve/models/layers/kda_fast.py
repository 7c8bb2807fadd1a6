"""The GPU path of the KDA layer (docs/ARCHITECTURE.md §7): one merged input GEMM, the fused Triton decode kernel
for one-token sequences, the Triton verify kernel for speculative verify rows (one call per row length), and
fla `chunk_kda` over all prefill sequences of the step in one varlen call.
Same function as `KimiDeltaAttention.forward` (the reference), up to bf16 rounding."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hyserve.models.batch import Batch, CacheTensors, to_device
from hyserve.models.layers.merged import merged
from hyserve.ops.dense_gemv import linear
from hyserve.ops.kda_conv import causal_conv_varlen_triton, conv_tail_rows
from hyserve.ops.kda_decode import kda_decode
from hyserve.ops.kda_out_norm import gated_rms_norm_rows
from hyserve.ops.kda_prefill import chunk_kda_varlen
from hyserve.ops.kda_verify_triton import kda_verify_multi
from hyserve.ops.kernel_plan import KernelPlan


def merged_in_proj(layer) -> tuple[torch.Tensor, list[int]]:
    """q|k|v|f_a|g_a (or g)|b weights stacked: one GEMM reads x once and, at batch 1, streams 3P+2K+H rows
    in one launch instead of six small ones."""
    gate_w = layer.g_proj.weight if hasattr(layer, "g_proj") else layer.g_a_proj.weight
    parts = [layer.q_proj.weight, layer.k_proj.weight, layer.v_proj.weight, layer.f_a_proj.weight, gate_w,
             layer.b_proj.weight]
    return merged(layer, "_merged_in", parts), [w.shape[0] for w in parts]


def merged_fg_b(layer) -> torch.Tensor:
    """f_b and g_b (both [P, K]) as one [2, K, P] operand: the two low-rank up-projections in one batched
    GEMM (at batch 1 each was a 4 µs launch for 1 MB)."""
    parts = (layer.f_b_proj.weight, layer.g_b_proj.weight)
    return merged(layer, "_merged_fg_b", parts, lambda ws: torch.stack([w.t() for w in ws]))


def _in_proj(layer, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv (pre-conv), f (gate input), b (beta logits) and the output gate's logits of every token."""
    t, p = x.shape[0], layer.num_heads * layer.head_dim
    w_in, split = merged_in_proj(layer)
    y = F.linear(x, w_in)
    qkv, fa, ga, b = y.split([3 * p, split[3], split[4], split[5]], -1)
    if hasattr(layer, "g_proj"):
        return qkv, layer.f_b_proj(fa), b, ga
    # f_a | g_a side by side in y's rows are the two batches of one bmm operand: no stack copy
    fg_a = y.as_strided((2, t, split[3]), (split[3], y.stride(0), 1), y.storage_offset() + 3 * p)
    f, gate = torch.bmm(fg_a, merged_fg_b(layer)).unbind(0)
    return qkv, f, b, gate


def kda_forward_fast(layer, x: torch.Tensor, batch: Batch, cache: CacheTensors, plan: KernelPlan) -> torch.Tensor:
    """A step's plain decodes through the decode kernel, its verify rows through the verify kernel (one call
    per row length) and its prefill chunks through one fla varlen call, each writing its own rows of the
    output; then the o_proj over all of them."""
    t, h = x.shape[0], layer.num_heads
    scale = layer.head_dim**-0.5
    qkv, f, b, gate = _in_proj(layer, x)
    conv_pool = cache.conv[:, layer.kda_index]
    rec_pool = cache.recurrent[:, layer.kda_index]
    args = (layer.conv_weight, conv_pool, rec_pool, layer.A_log, layer.dt_bias, layer.o_norm_weight)
    if batch.decode_only:
        out = kda_decode(qkv, f, b, gate, *args, batch.state_slots, batch.fresh_state, scale, layer.eps,
                         layer.lower_bound, fused_finish=plan.kda_fused_norm(t * h))
        return linear(out, layer.o_proj.weight, config=plan.linear_gemv(out, layer.o_proj.weight))

    groups = batch.verify_groups
    if len(groups) == 1 and groups[0].whole_step:  # a verify step of one draft count: no gather, no scatter
        g = groups[0]
        out = kda_verify_multi(qkv, f, b, gate, *args, g.slot_table, g.src, scale, layer.eps, layer.lower_bound,
                               g.tokens)
        return linear(out, layer.o_proj.weight, config=plan.linear_gemv(out, layer.o_proj.weight))

    out = torch.empty(t, h * layer.head_dim, dtype=x.dtype, device=x.device)
    dec = [i for i, n in enumerate(batch.query_lens) if n == 1]
    if dec:
        idx = to_device(dec, torch.long, x.device)
        tok = batch.cu_seqlens[idx]
        out[tok] = kda_decode(qkv[tok], f[tok], b[tok], gate[tok], *args, batch.state_slots[idx],
                              batch.fresh_state[idx], scale, layer.eps, layer.lower_bound,
                              fused_finish=plan.kda_fused_norm(len(dec) * h))
    for g in groups:
        r = g.rows
        out[r] = kda_verify_multi(qkv[r], f[r], b[r], gate[r], *args, g.slot_table, g.src, scale, layer.eps,
                                  layer.lower_bound, g.tokens)
    if batch.prefill_seqs:
        out = _prefill(layer, out, qkv, f, b, gate, batch, conv_pool, rec_pool)
    return linear(out, layer.o_proj.weight, config=plan.linear_gemv(out, layer.o_proj.weight))


def _prefill(layer, out, qkv, f, b, gate, batch: Batch, conv_pool, rec_pool) -> torch.Tensor:
    """The step's prefill chunks in one fla varlen call. Returns the step's output rows: `out` with the
    chunks' rows written in, or the call's own output when the chunks are the whole step (no scatter)."""
    h, k = layer.num_heads, layer.head_dim
    pre = batch.prefill_rows
    tok, tp = pre.tokens, pre.num_tokens
    tails = conv_pool[pre.slots].masked_fill(pre.fresh[:, None, None], 0)
    init = rec_pool[pre.slots].masked_fill(pre.fresh[:, None, None, None], 0)  # masked_fill: fresh slots may hold NaN
    y, new_tails = causal_conv_varlen_triton(qkv[tok], layer.conv_weight, pre.cu, tails, seq_of_token=pre.seq_of_token,
                                             tail_rows=pre.memo("conv_tails", lambda: conv_tail_rows(pre.cu, tails.shape[-1])))
    q, kk, v = (z.contiguous() for z in y.view(tp, 3, h, k).unbind(1))
    o, final = chunk_kda_varlen(
        q, kk, v, f[tok].view(tp, h, k), b[tok].contiguous(), layer.A_log, layer.dt_bias, layer.lower_bound,
        k**-0.5, init, pre.cu, pre.cu_host,
    )
    conv_pool[pre.slots] = new_tails.to(conv_pool.dtype)
    rec_pool[pre.slots] = final
    o = gated_rms_norm_rows(o.contiguous(), gate[tok], layer.o_norm_weight, layer.eps, out.dtype)
    if pre.whole_step:
        return o
    out[tok] = o
    return out
