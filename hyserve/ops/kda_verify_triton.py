"""KDA verify step on the GPU: `kda_decode_multi` (hyserve/ops/kda_decode.py) with one state slot per
token (the contract of hyserve/ops/kda_verify.py).

Each of N sequences brings T tokens (the last sampled token and T-1 drafts), rows sequence-major. The
state is read from slot_table[n, src[n]] and the state after token t is written to slot_table[n, t],
recurrent matrix and conv window alike, so the next step starts from the accepted column without a
copy. The steps:
1. the source windows are gathered into a scratch [N, 3P, W-1] first (column src may also be token 0's
   destination), and the window after each token is written to its slot from the scratch and the
   token rows (torch: a gather, a concatenation and one indexed store);
2. the decode path's prep kernel, run on the scratch (slot n = row n), computes the conv, gate, beta
   and q/k norms of every token;
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


def _conv_windows(x: torch.Tensor, conv_pool: torch.Tensor, slot_table: torch.Tensor, src: torch.Tensor,
                  t: int, w: int) -> torch.Tensor:
    """Write the window after each token to its slot; returns the source windows' copy [N, 3P, W-1]."""
    n = slot_table.shape[0]
    scratch = conv_pool[slot_table.gather(1, src.view(n, 1).long()).view(n)]
    rows = torch.cat([scratch, x.reshape(n, t, -1).transpose(1, 2).to(conv_pool.dtype)], -1)  # [N, 3P, W-1+T]
    windows = torch.stack([rows[..., j + 1 : j + w] for j in range(t)], 1)  # [N, T, 3P, W-1]
    conv_pool[slot_table[:, :t].reshape(-1)] = windows.reshape(n * t, *windows.shape[2:])
    return scratch


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
    scratch = _conv_windows(x, conv_pool, slot_table, src, t, w)
    lb, bounded = 0.0 if lower_bound is None else float(lower_bound), lower_bound is not None
    qkvg = torch.empty(n * t, h, 4, kd, dtype=torch.float32, device=x.device)
    beta = torch.empty(n * t, h, dtype=torch.float32, device=x.device)
    o_raw = torch.empty(n * t, p, dtype=torch.float32, device=x.device)
    rows = torch.arange(n, device=x.device)
    fresh = torch.zeros(n, dtype=torch.bool, device=x.device)
    _kda_prep_kernel[(n, h)](
        x, x.stride(0), f, f.stride(0), b, b.stride(0), conv_weight, scratch, *scratch.stride(),
        a_log, dt_bias, rows, fresh, qkvg, beta, p, h, scale, lb,
        T=t, K=kd, W=w, WP=triton.next_power_of_2(w), BOUNDED=bounded, PDL=False, num_warps=4,
    )
    bv = min(block_v, kd)
    _verify_state_kernel[(triton.cdiv(kd, bv), h, n)](
        qkvg, beta, rec_pool, *rec_pool.stride(), slot_table, slot_table.stride(0), src, o_raw, p, h,
        T=t, K=kd, BV=bv, num_warps=num_warps,
    )
    _kda_finish_kernel[(n, h)](gate, gate.stride(0), o_norm_weight, o_raw, out, out.stride(0), p, eps, T=t, K=kd,
                               num_warps=4)
    return out
