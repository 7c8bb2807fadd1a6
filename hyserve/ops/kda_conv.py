"""The KDA short conv of a prefill step as one Triton launch (docs/ARCHITECTURE.md §7): the GPU twin of
`kda_prefill.causal_conv_varlen`, same contract, no autograd.

The torch version builds an extended buffer and sums W shifted gathers in fp32: about a dozen passes over
[T, 3P] tensors, half of them in fp32. At 8K tokens of the 48B shape that was about 3 ms per KDA layer,
most of the copies and fp32 elementwise kernels in the prefill profile (2026-11-30). Here each program
reads its tile of W shifted input rows once, from the token rows or, before a sequence's start, from its
tail, and writes SiLU(conv) once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _conv_varlen_kernel(
    x_ptr, s_xt, w_ptr, tails_ptr, s_tn, s_tc, s_tw, seq_ptr, cu_ptr, y_ptr, s_yt, T, C,
    W: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
):
    """y[t, c] = SiLU(Σ_j w[c, j] · in(t - W + 1 + j, c)) for a [BT, BC] tile, where in(p) is token row p
    inside t's sequence and the sequence's tail (oldest first) before its start. fp32 sums in j order,
    inputs rounded to x's dtype first, as the torch version computes."""
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    tm = t < T
    cm = c < C
    s = tl.load(seq_ptr + t, mask=tm, other=0)
    start = tl.load(cu_ptr + s, mask=tm, other=0)
    acc = tl.zeros([BT, BC], tl.float32)
    m = tm[:, None] & cm[None, :]
    rows = x_ptr + t.to(tl.int64)[:, None] * s_xt + c[None, :]
    if tl.min(tl.where(tm, t - start, W), axis=0) >= W - 1:
        # every window of the tile lies inside its sequence (all tiles but a sequence's first): plain
        # shifted row loads, no tail addressing
        for j in tl.static_range(W):
            xv = tl.load(rows - (W - 1 - j) * s_xt, mask=m, other=0.0)
            acc += xv.to(tl.float32) * tl.load(w_ptr + c * W + j, mask=cm, other=0.0)[None, :]
    else:
        for j in tl.static_range(W):
            p = t - (W - 1) + j
            inside = p >= start
            xv = tl.load(x_ptr + tl.maximum(p, 0).to(tl.int64)[:, None] * s_xt + c[None, :],
                         mask=m & inside[:, None], other=0.0)
            ti = tl.minimum(tl.maximum(p - start + (W - 1), 0), W - 2)  # clamped: no lane addresses outside the tail
            tv = tl.load(tails_ptr + s.to(tl.int64)[:, None] * s_tn + c[None, :] * s_tc + ti[:, None] * s_tw,
                         mask=m & (~inside)[:, None], other=0.0)
            v = tl.where(inside[:, None], xv.to(tl.float32), tv.to(x_ptr.dtype.element_ty).to(tl.float32))
            acc += v * tl.load(w_ptr + c * W + j, mask=cm, other=0.0)[None, :]
    y = acc * tl.sigmoid(acc)
    tl.store(y_ptr + t.to(tl.int64)[:, None] * s_yt + c[None, :], y.to(y_ptr.dtype.element_ty),
             mask=tm[:, None] & cm[None, :])


def conv_tail_rows(cu_seqlens: torch.Tensor, wm1: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(source token row [N, W-1] (clamped), whether it lies inside the sequence, the old tail's index
    otherwise) of each sequence's new tail: the same for every KDA layer of a step (`PrefillRows`)."""
    p = cu_seqlens[1:, None] - wm1 + torch.arange(wm1, device=cu_seqlens.device)
    inside = p >= cu_seqlens[:-1, None]
    ti = (p - cu_seqlens[:-1, None] + wm1).clamp(0, wm1 - 1)
    return p.clamp(min=0), inside, ti


def new_conv_tails(x: torch.Tensor, cu_seqlens: torch.Tensor, tails: torch.Tensor,
                   rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """The last W-1 inputs of each sequence of [tail, tokens] (x's dtype, [N, C, W-1], oldest first):
    token rows where the sequence has them, the old tail's newest entries where it is shorter. `rows`:
    `conv_tail_rows(cu_seqlens, W-1)`, when the caller has it."""
    n, c, wm1 = tails.shape
    src, inside, ti = rows if rows is not None else conv_tail_rows(cu_seqlens, wm1)
    from_tail = tails.transpose(1, 2).to(x.dtype).gather(1, ti[:, :, None].expand(n, wm1, c))
    return torch.where(inside[:, :, None], x[src], from_tail).transpose(1, 2).contiguous()


def causal_conv_varlen_triton(
    x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor, tails: torch.Tensor,
    block_t: int = 64, block_c: int = 128, num_warps: int = 4, seq_of_token: torch.Tensor | None = None,
    tail_rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`causal_conv_varlen`: x [T, C] (unit stride in C), weight [C, W], cu_seqlens [N+1] long on x's device,
    tails [N, C, W-1]. Returns (SiLU(conv) [T, C] and the new tails [N, C, W-1], both in x's dtype).
    `seq_of_token` ([T] int32, each token's sequence) and `tail_rows` (`conv_tail_rows`) are derived from
    cu_seqlens alone: a step passes the ones it built once for all its layers."""
    t, c = x.shape
    w = weight.shape[-1]
    n = cu_seqlens.numel() - 1
    assert x.stride(-1) == 1 and tails.shape == (n, c, w - 1) and w >= 2
    y = torch.empty(t, c, dtype=x.dtype, device=x.device)
    if t == 0:
        return y, tails.to(x.dtype)
    if seq_of_token is None:
        seq_of_token = torch.repeat_interleave(torch.arange(n, device=x.device, dtype=torch.int32),
                                               cu_seqlens.diff(), output_size=t)
    wf = weight.float().contiguous()
    _conv_varlen_kernel[(triton.cdiv(t, block_t), triton.cdiv(c, block_c))](
        x, x.stride(0), wf, tails, *tails.stride(), seq_of_token, cu_seqlens, y, y.stride(0), t, c,
        W=w, BT=block_t, BC=block_c, num_warps=num_warps,
    )
    return y, new_conv_tails(x, cu_seqlens, tails, tail_rows)
