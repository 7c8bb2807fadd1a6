"""KDA verify step on the GPU: `kda_decode_multi` (hyserve/ops/kda_decode.py) with one state slot per
token (the contract of hyserve/ops/kda_verify.py).

Each of N sequences brings T tokens (the last sampled token and T-1 drafts), rows sequence-major. The
state is read from slot_table[n, src[n]] and the state after token t is written to slot_table[n, t],
recurrent matrix and conv window alike, so the next step starts from the accepted column without a
copy. The decode path's two launches (hyserve/ops/kda_decode.py `kda_steps`) in their verify mode, then
one of its own:
1. the prep kernel, reading the source window through the slot table, computes the conv, gate, beta and
   q/k norms of every token, a program per (sequence, head, token), and leaves the conv windows alone;
2. the state kernel, one program per (sequence, head, block of V rows): the source rows once into
   registers, then per token the delta-rule step, its output rows and the state rows to that token's
   slot (T stores: the price of rollback by slot choice); the last program of a head to arrive applies
   the gated RMSNorm (a third launch at many sequences, as in decode);
3. the windows kernel here writes the window after each token to its slot (every load before any store:
   column src may also be a token's destination).
With PDL each kernel launches while the one before it runs (prep -> state -> windows).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hyserve.ops.dispatch import use_pdl
from hyserve.ops.kda_decode import kda_steps
from hyserve.ops.kernel_plan import KDA_VERIFY_MAX_TOKENS


@triton.jit
def _verify_windows_kernel(x_ptr, s_xn, conv_ptr, s_cs, s_cc, s_cw, table_ptr, s_tn, src_ptr, C,
                           T: tl.constexpr, TP: tl.constexpr, W: tl.constexpr, WP: tl.constexpr, BC: tl.constexpr,
                           PDL: tl.constexpr):
    """Program (n, channel block): the conv window after each token t of sequence n (positions t+1 ..
    t+W-1 of [the source slot's W-1 inputs, the T token rows]) into slot table[n, t]. Every window is
    loaded before any store: the source slot may be one of the destinations. PDL (launched while the
    state kernel before it runs): the loads come before the wait, as no kernel in flight writes the conv
    windows or the token rows; the stores after it, when the prep kernel's reads of the source windows
    are done (the state kernel ends only after its own wait for the prep grid)."""
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
    if PDL:
        tl.extra.cuda.gdc_wait()
    tl.debug_barrier()  # every load of the source slot before any store (another thread may store over it)
    tl.store(conv_ptr + dst * s_cs + c * s_cc + j * s_cw, win, mask=live)


def kda_verify_multi(
    x: torch.Tensor, f: torch.Tensor, b: torch.Tensor, gate: torch.Tensor, conv_weight: torch.Tensor,
    conv_pool: torch.Tensor, rec_pool: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor,
    o_norm_weight: torch.Tensor, slot_table: torch.Tensor, src: torch.Tensor, scale: float, eps: float,
    lower_bound: float | None, tokens_per_seq: int, block_v: int = 8, num_warps: int = 4,
    fused_finish: bool | None = None,
) -> torch.Tensor:
    """T = tokens_per_seq tokens for each of N sequences (rows sequence-major); returns the normed output
    of every token [N*T, P]. Inputs as `kda_decode_multi`, with slot_table [N, >= T] (long or int32)
    and src [N] (the column to start from) in place of slots and fresh flags: verify rows always
    continue a sequence. fused_finish: as `kda_decode_multi`'s (None: the kernel plan's rule)."""
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
    out = kda_steps(x, f, b, gate, conv_weight, conv_pool, rec_pool, a_log, dt_bias, o_norm_weight, slot_table, src,
                    scale, eps, lower_bound, t, num_warps, block_v, fused_finish, None,
                    table_stride=slot_table.stride(0))
    if n == 0:
        return out
    pdl, bc = use_pdl(x, None), 64
    _verify_windows_kernel[(n, triton.cdiv(3 * p, bc))](
        x, x.stride(0), conv_pool, *conv_pool.stride(), slot_table, slot_table.stride(0), src, 3 * p,
        T=t, TP=triton.next_power_of_2(t), W=w, WP=triton.next_power_of_2(w), BC=bc, PDL=pdl, num_warps=4,
        **({"launch_pdl": True} if pdl else {}),
    )
    return out
