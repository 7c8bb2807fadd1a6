"""KDA verify step on the GPU: `kda_decode_multi` (hyserve/ops/kda_decode.py) with one state slot per
token (the contract of hyserve/ops/kda_verify.py).

Each of N sequences brings T tokens (the last sampled token and T-1 drafts), rows sequence-major. The
state is read from slot_table[n, src[n]] and the state after token t is written to slot_table[n, t],
recurrent matrix and conv window alike, so the next step starts from the accepted column without a
copy. The steps:
1. the decode path's prep kernel, reading the source window through the slot table (VERIFY), computes
   the conv, gate, beta and q/k norms of every token, a program per (sequence, head, token), and leaves
   the conv windows alone;
2. the windows kernel here writes the window after each token to its slot (every load before any store:
   column src may also be a token's destination);
3. the state kernel here, one program per (sequence, head, block of V rows): the source rows once into
   registers, then per token the delta-rule step, its output rows and the state rows to that token's
   slot (T stores: the price of rollback by slot choice);
4. the decode path's finish kernel: the gated RMSNorm of every token.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hyserve.ops.kda_decode import _delta_step, _kda_finish_kernel, _kda_prep_kernel
from hyserve.ops.kernel_plan import KDA_VERIFY_MAX_TOKENS


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


@triton.jit
def _verify_windows_kernel(x_ptr, s_xn, conv_ptr, s_cs, s_cc, s_cw, table_ptr, s_tn, src_ptr, C,
                           T: tl.constexpr, TP: tl.constexpr, W: tl.constexpr, WP: tl.constexpr, BC: tl.constexpr):
    """Program (n, channel block): the conv window after each token t of sequence n (positions t+1 ..
    t+W-1 of [the source slot's W-1 inputs, the T token rows]) into slot table[n, t]. Every window is
    loaded before any store: the source slot may be one of the destinations."""
    n = tl.program_id(0)
    c = (tl.program_id(1) * BC + tl.arange(0, BC))[:, None, None]
    t = tl.arange(0, TP)[None, :, None]
    j = tl.arange(0, WP)[None, None, :]
    p = t + 1 + j  # position in [tail, tokens]
    live = (c < C) & (t < T) & (j < W - 1)
    src = tl.load(table_ptr + n * s_tn + tl.load(src_ptr + n)).to(tl.int64)
    tail = tl.load(conv_ptr + src * s_cs + c * s_cc + p * s_cw, mask=live & (p < W - 1), other=0.0)
    tok = tl.minimum(tl.maximum(p - (W - 1), 0), T - 1)  # clamped so no lane forms an address outside x
    xv = tl.load(x_ptr + (n * T + tok) * s_xn + c, mask=live & (p >= W - 1), other=0.0)
    win = tl.where(p < W - 1, tail, xv.to(tail.dtype))
    dst = tl.load(table_ptr + n * s_tn + t, mask=t < T, other=0).to(tl.int64)
    tl.debug_barrier()  # every load of the source slot before any store (another thread may store over it)
    tl.store(conv_ptr + dst * s_cs + c * s_cc + j * s_cw, win, mask=live)


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
    h, kd, w = rec_pool.shape[1], rec_pool.shape[-1], conv_weight.shape[-1]
    p, n = h * kd, x.shape[0] // max(t, 1)
    if not 1 <= t <= KDA_VERIFY_MAX_TOKENS or n * t != x.shape[0]:
        raise ValueError(f"verify rows: 1 to {KDA_VERIFY_MAX_TOKENS} tokens per sequence, the same for every sequence")
    if any(y.stride(-1) != 1 or y.shape[0] != n * t for y in (x, f, b, gate)):
        raise ValueError("x, f, b and gate need one row per token and a unit-stride last dimension")
    if slot_table.shape[0] != n or src.shape[0] != n or slot_table.shape[1] < t or slot_table.stride(1) != 1:
        raise ValueError("slot_table [N, >= T] (unit-stride rows) and src [N] must describe the N sequences")
    if not conv_weight.is_contiguous() or rec_pool.shape[-2] != kd:
        raise ValueError("conv_weight must be contiguous [3P, W] and the state square [H, V, K] with V == K")
    out = torch.empty(n * t, p, dtype=x.dtype, device=x.device)
    if n == 0:
        return out
    lb, bounded = 0.0 if lower_bound is None else float(lower_bound), lower_bound is not None
    qkvg = torch.empty(n * t, h, 4, kd, dtype=torch.float32, device=x.device)
    beta = torch.empty(n * t, h, dtype=torch.float32, device=x.device)
    o_raw = torch.empty(n * t, p, dtype=torch.float32, device=x.device)
    wp = triton.next_power_of_2(w)
    _kda_prep_kernel[(n, h, t)](
        x, x.stride(0), f, f.stride(0), b, b.stride(0), conv_weight, conv_pool, *conv_pool.stride(),
        a_log, dt_bias, slot_table, src, qkvg, beta, p, h, scale, lb, slot_table.stride(0),
        T=t, K=kd, W=w, WP=wp, BOUNDED=bounded, PDL=False, VERIFY=True, num_warps=4,
    )
    bc = 64
    _verify_windows_kernel[(n, triton.cdiv(3 * p, bc))](
        x, x.stride(0), conv_pool, *conv_pool.stride(), slot_table, slot_table.stride(0), src, 3 * p,
        T=t, TP=triton.next_power_of_2(t), W=w, WP=wp, BC=bc, num_warps=4,
    )
    bv = min(block_v, kd)
    _verify_state_kernel[(triton.cdiv(kd, bv), h, n)](
        qkvg, beta, rec_pool, *rec_pool.stride(), slot_table, slot_table.stride(0), src, o_raw, p, h,
        T=t, K=kd, BV=bv, num_warps=num_warps,
    )
    _kda_finish_kernel[(n, h)](gate, gate.stride(0), o_norm_weight, o_raw, out, out.stride(0), p, eps, T=t, K=kd,
                               num_warps=4)
    return out
