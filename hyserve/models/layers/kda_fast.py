"""The GPU path of the KDA layer (docs/ARCHITECTURE.md §7): one merged input GEMM, the fused Triton decode kernel
for one-token sequences, and fla `chunk_kda` over all prefill sequences of the step in one varlen call.
Same function as `KimiDeltaAttention.forward` (the reference), up to bf16 rounding."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hyserve.models.batch import Batch, CacheTensors, to_device
from hyserve.models.layers.merged import merged
from hyserve.ops.dense_gemv import linear
from hyserve.ops.kda_conv import causal_conv_varlen_triton
from hyserve.ops.kda_decode import kda_decode
from hyserve.ops.kda_out_norm import gated_rms_norm_rows
from hyserve.ops.kda_prefill import chunk_kda_varlen
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


def _token_index(cu: list[int], seqs: list[int], device: torch.device) -> torch.Tensor:
    return torch.cat([torch.arange(cu[i], cu[i + 1]) for i in seqs]).to(device, non_blocking=True)


def kda_forward_fast(layer, x: torch.Tensor, batch: Batch, cache: CacheTensors, plan: KernelPlan) -> torch.Tensor:
    t, h, k = x.shape[0], layer.num_heads, layer.head_dim
    p, scale = h * k, layer.head_dim**-0.5
    w_in, split = merged_in_proj(layer)
    y = F.linear(x, w_in)
    qkv, fa, ga, b = y.split([3 * p, split[3], split[4], split[5]], -1)
    if hasattr(layer, "g_proj"):
        f, gate = layer.f_b_proj(fa), ga
    else:  # f_a | g_a side by side in y's rows are the two batches of one bmm operand: no stack copy
        fg_a = y.as_strided((2, t, split[3]), (split[3], y.stride(0), 1), y.storage_offset() + 3 * p)
        f, gate = torch.bmm(fg_a, merged_fg_b(layer)).unbind(0)
    conv_pool = cache.conv[:, layer.kda_index]
    rec_pool = cache.recurrent[:, layer.kda_index]
    args = (layer.conv_weight, conv_pool, rec_pool, layer.A_log, layer.dt_bias, layer.o_norm_weight)
    qlens = batch.query_lens
    if batch.decode_only:
        out = kda_decode(qkv, f, b, gate, *args, batch.state_slots, batch.fresh_state, scale, layer.eps,
                         layer.lower_bound, fused_finish=plan.kda_fused_norm(t * h))
        return linear(out, layer.o_proj.weight, config=plan.linear_gemv(out, layer.o_proj.weight))

    out = torch.empty(t, p, dtype=x.dtype, device=x.device)
    dec = [i for i, n in enumerate(qlens) if n == 1]
    pre, cu_cpu, cu_p = batch.prefill_cu
    cu_host = [0]
    for n in qlens:
        cu_host.append(cu_host[-1] + n)
    if dec:
        idx = to_device(dec, torch.long, x.device)
        tok = batch.cu_seqlens[idx]
        out[tok] = kda_decode(qkv[tok], f[tok], b[tok], gate[tok], *args, batch.state_slots[idx],
                              batch.fresh_state[idx], scale, layer.eps, layer.lower_bound,
                              fused_finish=plan.kda_fused_norm(len(dec) * h))

    pidx = to_device(pre, torch.long, x.device)
    tok = None if not dec else _token_index(cu_host, pre, x.device)

    def rows(y: torch.Tensor) -> torch.Tensor:
        return y if tok is None else y[tok]

    tp = int(cu_cpu[-1])
    slots, fresh = batch.state_slots[pidx], batch.fresh_state[pidx]
    tails = conv_pool[slots].masked_fill(fresh[:, None, None], 0)
    init = rec_pool[slots].masked_fill(fresh[:, None, None, None], 0)  # masked_fill: fresh slots may hold NaN
    y, new_tails = causal_conv_varlen_triton(rows(qkv), layer.conv_weight, cu_p, tails)
    q, kk, v = (z.contiguous() for z in y.view(tp, 3, h, k).unbind(1))
    o, final = chunk_kda_varlen(
        q, kk, v, rows(f).view(tp, h, k), rows(b).contiguous(), layer.A_log, layer.dt_bias, layer.lower_bound,
        scale, init, cu_p, cu_cpu,
    )
    conv_pool[slots] = new_tails.to(conv_pool.dtype)
    rec_pool[slots] = final
    o = gated_rms_norm_rows(o.contiguous(), rows(gate), layer.o_norm_weight, layer.eps, x.dtype)
    if tok is None:
        out = o
    else:
        out[tok] = o
    return linear(out, layer.o_proj.weight, config=plan.linear_gemv(out, layer.o_proj.weight))
