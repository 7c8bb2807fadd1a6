"""Kimi Delta Attention layer (docs/ARCHITECTURE.md §4.2).

Prefill chunks run the chunked form per sequence; single-token decodes run the recurrence batched over
sequences. Both read and write the sequence's state slot in place (conv tail + fp32 recurrent matrix).
Speculative verify rows read column `src` of their slot row and write the state after each token to its
own column (ops/kda_verify.py). This module is the reference, the specification; where the kernel plan
has kernels for every kind of row in the step, `kda_fast.kda_forward_fast` runs it instead.
"""

from __future__ import annotations

import itertools

import torch
from torch import nn

from hyserve.models.batch import Batch, CacheTensors, VerifyRows, to_device
from hyserve.models.config import ModelConfig
from hyserve.models.layers.norm import gated_rms_norm, l2_normalize
from hyserve.ops import kda as kda_ops
from hyserve.ops import kda_verify
from hyserve.ops.kernel_plan import KernelPlan, active


def _linear(i: int, o: int) -> nn.Linear:
    return nn.Linear(i, o, bias=False)


class KimiDeltaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, kda_index: int):
        super().__init__()
        d, h, k = cfg.hidden_size, cfg.kda_num_heads, cfg.kda_head_dim
        p = h * k
        self.kda_index, self.num_heads, self.head_dim = kda_index, h, k
        self.eps, self.lower_bound = cfg.rms_norm_eps, cfg.gate_lower_bound
        self.q_proj, self.k_proj, self.v_proj = _linear(d, p), _linear(d, p), _linear(d, p)
        # q, k, v depthwise conv taps in one [3P, W] fp32 tensor (channel order q | k | v)
        self.conv_weight = nn.Parameter(torch.zeros(3 * p, cfg.conv_kernel_size, dtype=torch.float32))
        self.f_a_proj, self.f_b_proj = _linear(d, k), _linear(k, p)
        self.dt_bias = nn.Parameter(torch.zeros(p, dtype=torch.float32))
        self.A_log = nn.Parameter(torch.zeros(h, dtype=torch.float32))
        self.b_proj = _linear(d, h)
        if cfg.kda_full_rank_gate:
            self.g_proj = _linear(d, p)
        else:
            self.g_a_proj, self.g_b_proj = _linear(d, k), _linear(k, p)
        self.o_norm_weight = nn.Parameter(torch.ones(k, dtype=torch.float32))
        self.o_proj = _linear(p, d)

    def output_gate(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "g_proj"):
            return self.g_proj(x)
        return self.g_b_proj(self.g_a_proj(x))

    def forward(self, x: torch.Tensor, batch: Batch, cache: CacheTensors, plan: KernelPlan | None = None) -> torch.Tensor:
        plan = active(plan)
        if plan.train_fla:
            return self.train_forward(x, batch)
        if plan.kda_kernels(bool(batch.prefill_seqs), max(batch.verify_lens, default=0)):
            from hyserve.models.layers.kda_fast import kda_forward_fast

            return kda_forward_fast(self, x, batch, cache, plan)
        t, h, k = x.shape[0], self.num_heads, self.head_dim
        qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], -1)  # pre-conv, model dtype
        g = kda_ops.kda_gate(self.f_b_proj(self.f_a_proj(x)).view(t, h, k), self.A_log, self.dt_bias, self.lower_bound)
        beta = torch.sigmoid(self.b_proj(x).float())
        conv_pool = cache.conv[:, self.kda_index]
        rec_pool = cache.recurrent[:, self.kda_index]
        o = torch.empty(t, h, k, dtype=torch.float32, device=x.device)

        qlens = batch.query_lens
        decode = [i for i, n in enumerate(qlens) if n == 1]
        if decode:
            self._decode(decode, qkv, g, beta, o, batch, conv_pool, rec_pool)
        cu = batch.cu_seqlens_host
        verify = batch.verify.seqs if batch.verify is not None else ()
        for i, n in enumerate(qlens):
            if n > 1 and i not in verify:
                self._prefill(i, slice(cu[i], cu[i + 1]), qkv, g, beta, o, batch, conv_pool, rec_pool)
        if verify:
            self._verify(batch.verify, qkv, g, beta, o, cu, conv_pool, rec_pool)

        gate = self.output_gate(x).view(t, h, k)
        out = gated_rms_norm(o, gate, self.o_norm_weight, self.eps).reshape(t, h * k)
        return self.o_proj(out.to(x.dtype))

    def train_forward(self, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        """The training plan's KDA (CUDA + fla-core): fresh whole sequences through fla `chunk_kda`, which
        has a backward, with autograd through every projection (the serving path merges its weights
        detached). The reference layer's function; no state is read or written: training never decodes."""
        from fla.ops.kda import chunk_kda

        from hyserve.ops.kda_prefill import causal_conv_varlen

        t, h, k = x.shape[0], self.num_heads, self.head_dim
        qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], -1)
        tails = qkv.new_zeros(batch.num_seqs, 3 * h * k, self.conv_weight.shape[1] - 1)
        y, _ = causal_conv_varlen(qkv, self.conv_weight, batch.cu_seqlens, tails)
        q, kk, v = (z.contiguous() for z in y.view(t, 3, h, k).unbind(1))
        f = self.f_b_proj(self.f_a_proj(x)).view(t, h, k)
        # host-side offsets from the host lengths: `batch.cu_seqlens.cpu()` would sync with the GPU per layer
        cu_host = torch.tensor([0] + batch.query_lens, dtype=torch.long).cumsum(0)
        o, _ = chunk_kda(
            q[None], kk[None], v[None], f[None], self.b_proj(x)[None], scale=k**-0.5, initial_state=None,
            output_final_state=False, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
            use_beta_sigmoid_in_kernel=True, A_log=self.A_log, dt_bias=self.dt_bias, lower_bound=self.lower_bound,
            safe_gate=self.lower_bound is not None, cu_seqlens=batch.cu_seqlens, cu_seqlens_cpu=cu_host,
        )
        out = gated_rms_norm(o[0], self.output_gate(x).view(t, h, k), self.o_norm_weight, self.eps)
        return self.o_proj(out.reshape(t, h * k).to(x.dtype))

    def _split_qkv(self, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n, h, k = y.shape[0], self.num_heads, self.head_dim
        y = y.to(self.q_proj.weight.dtype).float()  # the conv output leaves the op in model dtype
        q, kk, v = y.view(n, 3, h, k).unbind(1)
        return l2_normalize(q), l2_normalize(kk), v

    def _decode(self, seqs, qkv, g, beta, o, batch, conv_pool, rec_pool) -> None:
        idx = torch.tensor(seqs, device=qkv.device)
        tok = batch.cu_seqlens[idx]
        slots = batch.state_slots[idx]
        fresh = batch.fresh_state[idx]
        tails = conv_pool[slots]
        states = rec_pool[slots]
        if bool(fresh.any()):
            tails = tails.masked_fill(fresh[:, None, None], 0)
            states = states.masked_fill(fresh[:, None, None, None], 0)
        y, new_tails = kda_ops.short_conv_step(qkv[tok], self.conv_weight, tails)
        q, kk, v = self._split_qkv(y)
        out, new_states = kda_ops.kda_recurrent(q, kk, v, g[tok], beta[tok], states, self.head_dim**-0.5)
        o[tok] = out
        conv_pool[slots] = new_tails.to(conv_pool.dtype)
        rec_pool[slots] = new_states

    def _verify(self, rows: VerifyRows, qkv, g, beta, o, cu: list[int], conv_pool, rec_pool) -> None:
        """Each verify sequence from the state in column src of its slot row, the state after each of its
        tokens into its own column (a rejected token's state is never read again)."""
        lens = [cu[i + 1] - cu[i] for i in rows.seqs]
        tok = to_device([t for i in rows.seqs for t in range(cu[i], cu[i + 1])], torch.long, qkv.device)
        vcu = to_device([0, *itertools.accumulate(lens)], torch.long, qkv.device)
        y = kda_verify.conv_verify(qkv[tok], self.conv_weight, conv_pool, rows.slot_table, rows.src, vcu)
        q, kk, v = self._split_qkv(y)
        o[tok] = kda_verify.recurrent_verify(q, kk, v, g[tok], beta[tok], rec_pool, rows.slot_table, rows.src, vcu,
                                             self.head_dim**-0.5)

    def _prefill(self, i, sl, qkv, g, beta, o, batch, conv_pool, rec_pool) -> None:
        slot = int(batch.state_slots[i])
        fresh = bool(batch.fresh_state[i])
        tail = None if fresh else conv_pool[slot]
        state = rec_pool.new_zeros(rec_pool.shape[1:]) if fresh else rec_pool[slot]
        y, new_tail = kda_ops.short_conv(qkv[sl], self.conv_weight, tail)
        q, kk, v = self._split_qkv(y)
        out, new_state = kda_ops.kda_chunk(q, kk, v, g[sl], beta[sl], state, self.head_dim**-0.5)
        o[sl] = out
        conv_pool[slot] = new_tail.to(conv_pool.dtype)
        rec_pool[slot] = new_state
