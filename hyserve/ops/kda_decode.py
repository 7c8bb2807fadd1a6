"""Fused KDA decode step as one Triton launch (DESIGN.md §6; math: spec/models.md §2.4, §3.3).

Two launches. The state kernel runs one program per (sequence, head, block of V rows): short conv of
q/k/v, decay gate, β, q/k L2 norm and the delta-rule update of its rows of the fp32 [V, K] state, in
place in the slot. Splitting V gives small batches enough programs to fill the GPU (one program per
head held a 64 KB tile and reached 2% of copy bandwidth at batch 1 on an H200). The finish kernel
(one program per head) applies the gated RMSNorm, which needs the whole row, and shifts the conv tails.
The state is the bulk of the bytes: read once and written once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _conv_out(x_row, w_ptr, tail_ptr, s_cc, s_cw, c, fresh, W: tl.constexpr, WP: tl.constexpr):
    """SiLU(conv) of channels c from the old tail and the new input (the tail is only read here)."""
    j = tl.arange(0, WP)
    xv = tl.load(x_row + c).to(tl.float32)
    tail = tl.load(tail_ptr + c[:, None] * s_cc + j[None, :] * s_cw, mask=j[None, :] < W - 1, other=0.0)
    tail = tl.where(fresh, 0.0, tail.to(tl.float32))  # where, not a product: a fresh slot may hold NaN
    win = tl.where(j[None, :] == W - 1, xv[:, None], tail)  # oldest .. newest
    wt = tl.load(w_ptr + c[:, None] * W + j[None, :], mask=j[None, :] < W, other=0.0)
    y = tl.sum(win * wt, axis=1)
    return (y * tl.sigmoid(y)).to(x_row.dtype.element_ty).to(tl.float32)  # leaves the conv in model dtype


@triton.jit
def _kda_state_kernel(
    x_ptr, s_xn, f_ptr, s_fn, b_ptr, s_bn,
    conv_w_ptr, conv_ptr, s_cs, s_cc, s_cw,
    rec_ptr, s_rs, s_rh, s_rv, s_rk,
    a_log_ptr, dt_bias_ptr, slots_ptr, fresh_ptr, o_ptr,
    P, scale, lower_bound,
    K: tl.constexpr, BV: tl.constexpr, W: tl.constexpr, WP: tl.constexpr, BOUNDED: tl.constexpr,
):
    """Program (n, h, vb): rows vb*BV.. of head h's state. q and k (all K channels) are recomputed by
    every row block of the head, which is cheaper than a second pass; the conv tails are only read."""
    n = tl.program_id(0)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    slot = tl.load(slots_ptr + n).to(tl.int64)
    fresh = tl.load(fresh_ptr + n) != 0
    offs = tl.arange(0, K)
    rows = vb * BV + tl.arange(0, BV)
    x_row = x_ptr + n * s_xn
    tail_ptr = conv_ptr + slot * s_cs
    q = _conv_out(x_row, conv_w_ptr, tail_ptr, s_cc, s_cw, h * K + offs, fresh, W, WP)
    k = _conv_out(x_row, conv_w_ptr, tail_ptr, s_cc, s_cw, P + h * K + offs, fresh, W, WP)
    v = _conv_out(x_row, conv_w_ptr, tail_ptr, s_cc, s_cw, 2 * P + h * K + rows, fresh, W, WP)
    q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6) * scale
    k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)

    f = tl.load(f_ptr + n * s_fn + h * K + offs).to(tl.float32) + tl.load(dt_bias_ptr + h * K + offs)
    a = tl.exp(tl.load(a_log_ptr + h))
    if BOUNDED:
        g = lower_bound * tl.sigmoid(a * f)
    else:
        g = -a * tl.where(f > 20.0, f, tl.log(1.0 + tl.exp(tl.minimum(f, 20.0))))
    beta = tl.sigmoid(tl.load(b_ptr + n * s_bn + h).to(tl.float32))

    sp = rec_ptr + slot * s_rs + h * s_rh + rows[:, None] * s_rv + offs[None, :] * s_rk
    m = tl.load(sp)
    m = tl.where(fresh, 0.0, m) * tl.exp(g)[None, :]  # decay the key columns
    pred = tl.sum(m * k[None, :], axis=1)
    m = m + (beta * (v - pred))[:, None] * k[None, :]
    tl.store(sp, m)
    tl.store(o_ptr + n * P + h * K + rows, tl.sum(m * q[None, :], axis=1))


@triton.jit
def _kda_finish_kernel(
    x_ptr, s_xn, gate_ptr, s_gn, conv_ptr, s_cs, s_cc, s_cw, slots_ptr, fresh_ptr, onorm_ptr, o_ptr,
    out_ptr, s_on, P, eps,
    K: tl.constexpr, W: tl.constexpr, WP: tl.constexpr,
):
    """Program (n, h): gated RMSNorm of the head's output, and the conv-tail shift of its q/k/v channels
    (after the state kernel, so no program can read a tail that was already shifted)."""
    n = tl.program_id(0)
    h = tl.program_id(1)
    offs = tl.arange(0, K)
    o = tl.load(o_ptr + n * P + h * K + offs)
    gate = tl.load(gate_ptr + n * s_gn + h * K + offs).to(tl.float32)
    o = o * tl.rsqrt(tl.sum(o * o, axis=0) / K + eps) * tl.load(onorm_ptr + offs) * tl.sigmoid(gate)
    tl.store(out_ptr + n * s_on + h * K + offs, o.to(out_ptr.dtype.element_ty))

    slot = tl.load(slots_ptr + n).to(tl.int64)
    fresh = tl.load(fresh_ptr + n) != 0
    j = tl.arange(0, WP)
    i = tl.arange(0, 4 * K)  # the 3 parts (q, k, v) of the head, padded to a power of two
    c = (i // K) * P + h * K + i % K
    cm = i < 3 * K
    tail_ptr = conv_ptr + slot * s_cs
    old = tl.load(tail_ptr + c[:, None] * s_cc + (j[None, :] + 1) * s_cw, mask=cm[:, None] & (j[None, :] + 1 < W - 1),
                  other=0.0)
    old = tl.where(fresh, 0.0, old)
    xv = tl.load(x_ptr + n * s_xn + c, mask=cm, other=0.0)
    new = tl.where(j[None, :] == W - 2, xv[:, None].to(old.dtype), old)
    tl.debug_barrier()  # every load of the old tail before any store (other threads shift the same rows)
    tl.store(tail_ptr + c[:, None] * s_cc + j[None, :] * s_cw, new, mask=cm[:, None] & (j[None, :] < W - 1))


def kda_decode(
    x: torch.Tensor, f: torch.Tensor, b: torch.Tensor, gate: torch.Tensor, conv_weight: torch.Tensor,
    conv_pool: torch.Tensor, rec_pool: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor,
    o_norm_weight: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor, scale: float, eps: float,
    lower_bound: float | None, num_warps: int = 4, block_v: int | None = None,
) -> torch.Tensor:
    """One token for each of N sequences; updates the slots in place, returns the normed output [N, P].

    x [N, 3P] pre-conv q|k|v; f [N, P] raw gate input; b [N, H] β logits; gate [N, P] output-gate
    logits (each may be a column slice of a wider projection: only the last dim must be unit-stride);
    conv_pool [slots, 3P, W-1] and rec_pool [slots, H, V, K] are this layer's views of the pools.
    """
    n, h, kd = x.shape[0], rec_pool.shape[1], rec_pool.shape[-1]
    p = h * kd
    w = conv_weight.shape[-1]
    for t in (x, f, b, gate):
        assert t.stride(-1) == 1
    assert conv_weight.is_contiguous() and rec_pool.shape[-2] == kd
    out = torch.empty(n, p, dtype=x.dtype, device=x.device)
    if n == 0:
        return out
    bv = block_v or (32 if n * h >= 4 * 132 else 16)  # small batches: more, smaller programs
    o_raw = torch.empty(n, p, dtype=torch.float32, device=x.device)
    wp = triton.next_power_of_2(w)
    _kda_state_kernel[(n, h, triton.cdiv(kd, bv))](
        x, x.stride(0), f, f.stride(0), b, b.stride(0),
        conv_weight, conv_pool, *conv_pool.stride(),
        rec_pool, *rec_pool.stride(),
        a_log, dt_bias, slots, fresh, o_raw,
        p, scale, 0.0 if lower_bound is None else float(lower_bound),
        K=kd, BV=bv, W=w, WP=wp, BOUNDED=lower_bound is not None, num_warps=num_warps,
    )
    _kda_finish_kernel[(n, h)](
        x, x.stride(0), gate, gate.stride(0), conv_pool, *conv_pool.stride(), slots, fresh, o_norm_weight, o_raw,
        out, out.stride(0), p, eps, K=kd, W=w, WP=wp, num_warps=4,
    )
    return out
