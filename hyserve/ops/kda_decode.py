"""Fused KDA decode as two Triton launches (DESIGN.md §6; math: spec/models.md §2.4, §3.3).

Each of N sequences brings the same number T of new tokens (T = 1: plain decode; T > 1: e.g. verifying
T-1 speculative draft tokens + 1), token rows sequence-major: sequence n owns rows n*T .. n*T+T-1.
The state kernel runs one program per (sequence, head, block of V rows): for each token in order, short
conv of q/k/v, decay gate, β, q/k L2 norm and the delta-rule update of its rows of the fp32 [V, K] state,
which stays in registers across the T steps and goes back to the slot once. Splitting V gives small
batches enough programs to fill the GPU (one program per head held a 64 KB tile and reached 2% of copy
bandwidth at batch 1 on an H200). The finish kernel (one program per (sequence, head)) applies the gated
RMSNorm, which needs the whole row, and shifts the conv tails. The state is the bulk of the bytes: read
once and written once per sequence, whatever T.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _window_of(x_ptr, s_xn, row0, tail_ptr, s_cc, s_cw, c, p0, fresh, T: tl.constexpr, W: tl.constexpr,
               WP: tl.constexpr, WIDTH: tl.constexpr):
    """[C, WP] inputs of channels c at positions p0 .. p0+WIDTH-1 of the sequence [old tail (W-1), new tokens
    (T)]; positions before W-1 come from the slot's tail (zero when fresh), the rest from the token rows."""
    j = tl.arange(0, WP)
    p = p0 + j
    live = j < WIDTH
    tail = tl.load(tail_ptr + c[:, None] * s_cc + p[None, :] * s_cw, mask=(live & (p < W - 1))[None, :], other=0.0)
    tail = tl.where(fresh, 0.0, tail)  # where, not a product: a fresh slot may hold NaN
    tok = tl.minimum(tl.maximum(p - (W - 1), 0), T - 1)  # clamped so no lane forms an address outside x
    xv = tl.load(x_ptr + (row0 + tok)[None, :] * s_xn + c[:, None], mask=(live & (p >= W - 1))[None, :], other=0.0)
    return tl.where((p < W - 1)[None, :], tail.to(xv.dtype), xv)


@triton.jit
def _conv_out(x_ptr, s_xn, row0, t, w_ptr, tail_ptr, s_cc, s_cw, c, fresh, T: tl.constexpr, W: tl.constexpr,
              WP: tl.constexpr):
    """SiLU(conv) of channels c for new token t (the tail is only read here)."""
    win = _window_of(x_ptr, s_xn, row0, tail_ptr, s_cc, s_cw, c, t, fresh, T, W, WP, W).to(tl.float32)
    j = tl.arange(0, WP)
    wt = tl.load(w_ptr + c[:, None] * W + j[None, :], mask=j[None, :] < W, other=0.0)
    y = tl.sum(win * wt, axis=1)
    return (y * tl.sigmoid(y)).to(x_ptr.dtype.element_ty).to(tl.float32)  # leaves the conv in model dtype


@triton.jit
def _kda_state_kernel(
    x_ptr, s_xn, f_ptr, s_fn, b_ptr, s_bn,
    conv_w_ptr, conv_ptr, s_cs, s_cc, s_cw,
    rec_ptr, s_rs, s_rh, s_rv, s_rk,
    a_log_ptr, dt_bias_ptr, slots_ptr, fresh_ptr, o_ptr,
    P, scale, lower_bound,
    T: tl.constexpr, K: tl.constexpr, BV: tl.constexpr, W: tl.constexpr, WP: tl.constexpr,
    BOUNDED: tl.constexpr,
):
    """Program (n, h, vb): rows vb*BV.. of head h's state over the sequence's T tokens. q and k (all K
    channels) are recomputed by every row block of the head, which is cheaper than a second pass; the
    conv tails are only read (the finish kernel shifts them once every program has read them)."""
    n = tl.program_id(0)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    slot = tl.load(slots_ptr + n).to(tl.int64)
    fresh = tl.load(fresh_ptr + n) != 0
    offs = tl.arange(0, K)
    rows = vb * BV + tl.arange(0, BV)
    row0 = n * T
    tail_ptr = conv_ptr + slot * s_cs
    a = tl.exp(tl.load(a_log_ptr + h))
    dtb = tl.load(dt_bias_ptr + h * K + offs)
    sp = rec_ptr + slot * s_rs + h * s_rh + rows[:, None] * s_rv + offs[None, :] * s_rk
    m = tl.where(fresh, 0.0, tl.load(sp))
    for t in range(T):
        q = _conv_out(x_ptr, s_xn, row0, t, conv_w_ptr, tail_ptr, s_cc, s_cw, h * K + offs, fresh, T, W, WP)
        k = _conv_out(x_ptr, s_xn, row0, t, conv_w_ptr, tail_ptr, s_cc, s_cw, P + h * K + offs, fresh, T, W, WP)
        v = _conv_out(x_ptr, s_xn, row0, t, conv_w_ptr, tail_ptr, s_cc, s_cw, 2 * P + h * K + rows, fresh, T, W, WP)
        q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6) * scale
        k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
        f = tl.load(f_ptr + (row0 + t) * s_fn + h * K + offs).to(tl.float32) + dtb
        if BOUNDED:
            g = lower_bound * tl.sigmoid(a * f)
        else:
            g = -a * tl.where(f > 20.0, f, tl.log(1.0 + tl.exp(tl.minimum(f, 20.0))))
        beta = tl.sigmoid(tl.load(b_ptr + (row0 + t) * s_bn + h).to(tl.float32))
        m = m * tl.exp(g)[None, :]  # decay the key columns
        pred = tl.sum(m * k[None, :], axis=1)
        m = m + (beta * (v - pred))[:, None] * k[None, :]
        tl.store(o_ptr + (row0 + t) * P + h * K + rows, tl.sum(m * q[None, :], axis=1))
    tl.store(sp, m)


@triton.jit
def _kda_finish_kernel(
    x_ptr, s_xn, gate_ptr, s_gn, conv_ptr, s_cs, s_cc, s_cw, slots_ptr, fresh_ptr, onorm_ptr, o_ptr,
    out_ptr, s_on, P, eps,
    T: tl.constexpr, K: tl.constexpr, W: tl.constexpr, WP: tl.constexpr,
):
    """Program (n, h): gated RMSNorm of the head's output for each token, and the conv-tail shift of its
    q/k/v channels (after the state kernel, so no program can read a tail that was already shifted)."""
    n = tl.program_id(0)
    h = tl.program_id(1)
    offs = tl.arange(0, K)
    wn = tl.load(onorm_ptr + offs)
    for t in range(T):
        r = n * T + t
        o = tl.load(o_ptr + r * P + h * K + offs)
        gate = tl.load(gate_ptr + r * s_gn + h * K + offs).to(tl.float32)
        o = o * tl.rsqrt(tl.sum(o * o, axis=0) / K + eps) * wn * tl.sigmoid(gate)
        tl.store(out_ptr + r * s_on + h * K + offs, o.to(out_ptr.dtype.element_ty))

    slot = tl.load(slots_ptr + n).to(tl.int64)
    fresh = tl.load(fresh_ptr + n) != 0
    j = tl.arange(0, WP)
    i = tl.arange(0, 4 * K)  # the 3 parts (q, k, v) of the head, padded to a power of two
    c = tl.where(i < 3 * K, (i // K) * P + h * K + i % K, 0)  # padding lanes alias channel 0, never stored
    tail_ptr = conv_ptr + slot * s_cs
    # the new tail is the last W-1 positions of [old tail, T new tokens], i.e. positions T .. T+W-2
    new = _window_of(x_ptr, s_xn, n * T, tail_ptr, s_cc, s_cw, c, T, fresh, T, W, WP, W - 1)
    tl.debug_barrier()  # every load of the old tail before any store (other threads shift the same rows)
    tl.store(tail_ptr + c[:, None] * s_cc + j[None, :] * s_cw, new.to(conv_ptr.dtype.element_ty),
             mask=(i < 3 * K)[:, None] & (j[None, :] < W - 1))


def kda_decode_multi(
    x: torch.Tensor, f: torch.Tensor, b: torch.Tensor, gate: torch.Tensor, conv_weight: torch.Tensor,
    conv_pool: torch.Tensor, rec_pool: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor,
    o_norm_weight: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor, scale: float, eps: float,
    lower_bound: float | None, tokens_per_seq: int, num_warps: int = 4, block_v: int | None = None,
) -> torch.Tensor:
    """T = tokens_per_seq new tokens for each of N sequences (rows sequence-major, N*T in all): T recurrent
    steps per sequence, as T calls of `kda_decode` would make them. Updates the slots in place (state and
    conv tail end as after the last token) and returns the normed output of every token [N*T, P].

    x [N*T, 3P] pre-conv q|k|v; f [N*T, P] raw gate input; b [N*T, H] β logits; gate [N*T, P] output-gate
    logits (each may be a column slice of a wider projection: only the last dim must be unit-stride);
    slots, fresh [N]; conv_pool [slots, 3P, W-1] and rec_pool [slots, H, V, K] are this layer's views.
    """
    t = tokens_per_seq
    h, kd = rec_pool.shape[1], rec_pool.shape[-1]
    p = h * kd
    w = conv_weight.shape[-1]
    assert 1 <= t <= 16 and x.shape[0] % t == 0, "1 to 16 tokens per sequence, the same for every sequence"
    n = x.shape[0] // t
    for y in (x, f, b, gate):
        assert y.stride(-1) == 1 and y.shape[0] == n * t
    assert conv_weight.is_contiguous() and rec_pool.shape[-2] == kd and slots.shape[0] == fresh.shape[0] == n
    out = torch.empty(n * t, p, dtype=x.dtype, device=x.device)
    if n == 0:
        return out
    # small batches: more, smaller programs; never more rows than V (unmasked rows would reach other heads)
    bv = min(block_v or (32 if n * h >= 4 * 132 else 16), kd)
    o_raw = torch.empty(n * t, p, dtype=torch.float32, device=x.device)
    wp = triton.next_power_of_2(w)
    _kda_state_kernel[(n, h, triton.cdiv(kd, bv))](
        x, x.stride(0), f, f.stride(0), b, b.stride(0),
        conv_weight, conv_pool, *conv_pool.stride(),
        rec_pool, *rec_pool.stride(),
        a_log, dt_bias, slots, fresh, o_raw,
        p, scale, 0.0 if lower_bound is None else float(lower_bound),
        T=t, K=kd, BV=bv, W=w, WP=wp, BOUNDED=lower_bound is not None, num_warps=num_warps,
    )
    _kda_finish_kernel[(n, h)](
        x, x.stride(0), gate, gate.stride(0), conv_pool, *conv_pool.stride(), slots, fresh, o_norm_weight, o_raw,
        out, out.stride(0), p, eps, T=t, K=kd, W=w, WP=wp, num_warps=4,
    )
    return out


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
    return kda_decode_multi(x, f, b, gate, conv_weight, conv_pool, rec_pool, a_log, dt_bias, o_norm_weight, slots,
                            fresh, scale, eps, lower_bound, 1, num_warps, block_v)
