"""KDA verify step on the GPU: `kda_decode_multi` (hyserve/ops/kda_decode.py) with one state slot per
token (the contract of hyserve/ops/kda_verify.py).

Each of N sequences brings T tokens (the last sampled token and T-1 drafts), rows sequence-major. The
state is read from slot_table[n, src[n]] and the state after token t is written to slot_table[n, t],
recurrent matrix and conv window alike, so the next step starts from the accepted column without a
copy. Three launches, the decode kernels' helpers reused:
1. prep, one program per (sequence, head): copies the head's channels of the source window to a
   scratch first (the source slot may be one of the destinations), then the conv, gate, beta and q/k
   norms of every token from the scratch, then each token's window to its slot;
2. state, one program per (sequence, head, block of V rows): the source rows once into registers, then
   per token the delta-rule step, its output rows and the state rows to that token's slot (T stores:
   the price of rollback by slot choice);
3. the gated RMSNorm of every token (the decode path's finish kernel).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hyserve.ops.kda_decode import _conv_out, _decay_of, _delta_step, _head_lanes, _kda_finish_kernel, _window_of


@triton.jit
def _verify_prep_kernel(
    x_ptr, s_xn, f_ptr, s_fn, b_ptr, s_bn,
    conv_w_ptr, conv_ptr, s_cs, s_cc, s_cw, scratch_ptr, s_sn, s_sc, s_sw,
    a_log_ptr, dt_bias_ptr, table_ptr, s_tn, src_ptr, qkvg_ptr, beta_ptr,
    P, H, scale, lower_bound,
    T: tl.constexpr, K: tl.constexpr, W: tl.constexpr, WP: tl.constexpr, BOUNDED: tl.constexpr,
):
    """Program (n, h): rows 0..3 of qkvg[n*T+t, h] (q̂ scaled, k̂, v, exp(gate)) and σ(b) for every
    token, then the window after each token into its slot."""
    n = tl.program_id(0)
    h = tl.program_id(1)
    src_slot = tl.load(table_ptr + n * s_tn + tl.load(src_ptr + n)).to(tl.int64)
    row0 = n * T
    i, part, c = _head_lanes(P, h, K)
    live = part < 3
    j = tl.arange(0, WP)
    wmask = live[:, None] & (j[None, :] < W - 1)
    old = tl.load(conv_ptr + src_slot * s_cs + c[:, None] * s_cc + j[None, :] * s_cw, mask=wmask, other=0.0)
    tail_ptr = scratch_ptr + n * s_sn
    tl.store(tail_ptr + c[:, None] * s_sc + j[None, :] * s_sw, old, mask=wmask)
    tl.debug_barrier()  # the scratch copy before any read of it
    gl = tl.where(part == 3, i - 3 * K, 0)
    a = tl.exp(tl.load(a_log_ptr + h))
    dtb = tl.load(dt_bias_ptr + h * K + gl)
    for t in range(T):
        y = _conv_out(x_ptr, s_xn, row0, t, conv_w_ptr, tail_ptr, s_sc, s_sw, c, False, T, W, WP)
        qn = tl.rsqrt(tl.sum(tl.where(part == 0, y * y, 0.0), axis=0) + 1e-6) * scale
        kn = tl.rsqrt(tl.sum(tl.where(part == 1, y * y, 0.0), axis=0) + 1e-6)
        y = y * tl.where(part == 0, qn, tl.where(part == 1, kn, 1.0))
        f = tl.load(f_ptr + (row0 + t) * s_fn + h * K + gl).to(tl.float32) + dtb
        y = tl.where(part == 3, _decay_of(f, a, lower_bound, BOUNDED), y)
        tl.store(qkvg_ptr + ((row0 + t) * H + h) * 4 * K + i, y)
        tl.store(beta_ptr + (row0 + t) * H + h, tl.sigmoid(tl.load(b_ptr + (row0 + t) * s_bn + h).to(tl.float32)))
    for t in range(T):
        # the window after token t: positions t+1 .. t+W-1 of [source window (W-1), the T tokens]
        new = _window_of(x_ptr, s_xn, row0, tail_ptr, s_sc, s_sw, c, t + 1, False, T, W, WP, W - 1)
        dst = tl.load(table_ptr + n * s_tn + t).to(tl.int64)
        tl.store(conv_ptr + dst * s_cs + c[:, None] * s_cc + j[None, :] * s_cw, new.to(conv_ptr.dtype.element_ty),
                 mask=wmask)


@triton.jit
def _verify_state_kernel(
    qkvg_ptr, beta_ptr, rec_ptr, s_rs, s_rh, s_rv, s_rk, table_ptr, s_tn, src_ptr, o_ptr, P, H,
    T: tl.constexpr, K: tl.constexpr, BV: tl.constexpr,
):
    """Program (vb, h, n): rows vb*BV.. of head h over the sequence's T tokens."""
    vb = tl.program_id(0)
    h = tl.program_id(1)
    n = tl.program_id(2)
    src_slot = tl.load(table_ptr + n * s_tn + tl.load(src_ptr + n)).to(tl.int64)
    offs = tl.arange(0, K)
    rows = vb * BV + tl.arange(0, BV)
    sp = rec_ptr + h * s_rh + rows[:, None] * s_rv + offs[None, :] * s_rk
    m = tl.load(sp + src_slot * s_rs)  # read once, before any of this program's stores
    for t in range(T):
        r = n * T + t
        vec = qkvg_ptr + (r * H + h) * 4 * K
        m, o = _delta_step(m, tl.load(vec + offs), tl.load(vec + K + offs), tl.load(vec + 2 * K + rows),
                           tl.load(vec + 3 * K + offs), tl.load(beta_ptr + r * H + h))
        tl.store(o_ptr + r * P + h * K + rows, o)
        dst = tl.load(table_ptr + n * s_tn + t).to(tl.int64)
        tl.store(sp + dst * s_rs, m)


def kda_verify_multi(
    x: torch.Tensor, f: torch.Tensor, b: torch.Tensor, gate: torch.Tensor, conv_weight: torch.Tensor,
    conv_pool: torch.Tensor, rec_pool: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor,
    o_norm_weight: torch.Tensor, slot_table: torch.Tensor, src: torch.Tensor, scale: float, eps: float,
    lower_bound: float | None, tokens_per_seq: int, block_v: int = 8, num_warps: int = 4,
) -> torch.Tensor:
    """T = tokens_per_seq tokens for each of N sequences (rows sequence-major); returns the normed output
    of every token [N*T, P]. Inputs as `kda_decode_multi`, with slot_table [N, >= T] (long or int32)
    and src [N] (the column to start from) in place of slots and fresh flags: verify rows always
    continue a sequence."""
    t = tokens_per_seq
    h, kd = rec_pool.shape[1], rec_pool.shape[-1]
    p = h * kd
    w = conv_weight.shape[-1]
    assert 1 <= t <= 16 and x.shape[0] % t == 0, "1 to 16 tokens per sequence, the same for every sequence"
    n = x.shape[0] // t
    for y in (x, f, b, gate):
        assert y.stride(-1) == 1 and y.shape[0] == n * t
    assert slot_table.shape[0] == src.shape[0] == n and slot_table.shape[1] >= t and slot_table.stride(1) == 1
    assert conv_weight.is_contiguous() and rec_pool.shape[-2] == kd
    out = torch.empty(n * t, p, dtype=x.dtype, device=x.device)
    if n == 0:
        return out
    lb, bounded = 0.0 if lower_bound is None else float(lower_bound), lower_bound is not None
    qkvg = torch.empty(n * t, h, 4, kd, dtype=torch.float32, device=x.device)
    beta = torch.empty(n * t, h, dtype=torch.float32, device=x.device)
    o_raw = torch.empty(n * t, p, dtype=torch.float32, device=x.device)
    scratch = torch.empty(n, conv_pool.shape[1], w - 1, dtype=conv_pool.dtype, device=x.device)
    _verify_prep_kernel[(n, h)](
        x, x.stride(0), f, f.stride(0), b, b.stride(0), conv_weight, conv_pool, *conv_pool.stride(),
        scratch, *scratch.stride(), a_log, dt_bias, slot_table, slot_table.stride(0), src, qkvg, beta,
        p, h, scale, lb, T=t, K=kd, W=w, WP=triton.next_power_of_2(w), BOUNDED=bounded, num_warps=4,
    )
    bv = min(block_v, kd)
    _verify_state_kernel[(triton.cdiv(kd, bv), h, n)](
        qkvg, beta, rec_pool, *rec_pool.stride(), slot_table, slot_table.stride(0), src, o_raw, p, h,
        T=t, K=kd, BV=bv, num_warps=num_warps,
    )
    _kda_finish_kernel[(n, h)](gate, gate.stride(0), o_norm_weight, o_raw, out, out.stride(0), p, eps, T=t, K=kd,
                               num_warps=4)
    return out
