"""KDA over a verify step (reference, fp32, any device): 1+k tokens of a sequence from one state slot,
the state after EACH token written to its own slot (docs/speculative_decoding.md).

A sequence in a speculative step owns a row of 1+K state slots (`slot_table[i]`). The step reads the
state it starts from out of column `src[i]` of that row and writes the state after its token t into
column t, both the fp32 recurrent matrix and the conv window (the last W-1 pre-conv inputs). When the
rejection sampler has accepted a of the step's drafts, the state after the accepted tokens is in
column a: the next step passes src = a and nothing is copied. Column 0 is where a step without
drafts (or a plain decode) leaves its state, so every step has the same contract.

The math is the reference of hyserve/ops/kda.py (`short_conv`, `kda_recurrent`); only the slot
bookkeeping is new. hyserve/ops/kda_verify_triton.py is the GPU twin of the whole layer step.
"""

from __future__ import annotations

import torch

from hyserve.ops import kda as kda_ops


def _spans(cu_seqlens: torch.Tensor) -> list[tuple[int, int]]:
    cu = cu_seqlens.tolist()
    return list(zip(cu[:-1], cu[1:]))


def _check(slot_table: torch.Tensor, src: torch.Tensor, cu_seqlens: torch.Tensor) -> None:
    n = slot_table.shape[0]
    lens = cu_seqlens.diff()
    if src.shape[0] != n or cu_seqlens.shape[0] != n + 1:
        raise ValueError("slot_table, src and cu_seqlens must describe the same sequences")
    if bool((lens < 1).any()) or bool((lens > slot_table.shape[1]).any()):
        raise ValueError(f"each sequence brings 1 to {slot_table.shape[1]} tokens (one slot per token)")
    if bool((src < 0).any()) or bool((src >= slot_table.shape[1]).any()):
        raise ValueError("src must name a column of slot_table")


def conv_verify(
    x: torch.Tensor, weight: torch.Tensor, conv_pool: torch.Tensor, slot_table: torch.Tensor,
    src: torch.Tensor, cu_seqlens: torch.Tensor,
) -> torch.Tensor:
    """Causal depthwise conv + SiLU of each sequence's tokens from the window in slot src; the window
    after token t to slot_table[i, t].

    x [T, C] pre-conv inputs, weight [C, W], conv_pool [S, C, W-1] (oldest first), slot_table [N, 1+K]
    long, src [N] long, cu_seqlens [N+1] long. Returns SiLU(conv) [T, C] fp32.
    """
    _check(slot_table, src, cu_seqlens)
    w = weight.shape[-1]
    y = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    tails = []
    for i, (a, b) in enumerate(_spans(cu_seqlens)):
        tail = conv_pool[slot_table[i, src[i]]].clone()  # read before any write: src may be a destination
        y[a:b], _ = kda_ops.short_conv(x[a:b], weight, tail)
        window = torch.cat([tail.to(x.dtype), x[a:b].t()], 1)  # [C, W-1+n]: oldest first
        tails.append([window[:, t + 1 : t + w] for t in range(b - a)])
    for i, per_token in enumerate(tails):
        for t, tail in enumerate(per_token):
            conv_pool[slot_table[i, t]] = tail.to(conv_pool.dtype)
    return y


def recurrent_verify(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    rec_pool: torch.Tensor, slot_table: torch.Tensor, src: torch.Tensor, cu_seqlens: torch.Tensor, scale: float,
) -> torch.Tensor:
    """The delta-rule recurrence of each sequence's tokens from the state in slot src; the state after
    token t to slot_table[i, t].

    q, k [T, H, K] (L2-normalised), v [T, H, V], g [T, H, K] log decay, beta [T, H], rec_pool
    [S, H, V, K] fp32. Returns o [T, H, V] fp32 (float64 for float64 inputs, as the reference does).
    """
    _check(slot_table, src, cu_seqlens)
    o = torch.empty(v.shape, dtype=torch.float64 if v.dtype == torch.float64 else torch.float32, device=v.device)
    states = []
    for i, (a, b) in enumerate(_spans(cu_seqlens)):
        m = rec_pool[slot_table[i, src[i]]].unsqueeze(0).clone()
        per_token = []
        for t in range(a, b):
            o[t : t + 1], m = kda_ops.kda_recurrent(q[t : t + 1], k[t : t + 1], v[t : t + 1], g[t : t + 1],
                                                    beta[t : t + 1], m, scale)
            per_token.append(m[0])
        states.append(per_token)
    for i, per_token in enumerate(states):
        for t, m in enumerate(per_token):
            rec_pool[slot_table[i, t]] = m.to(rec_pool.dtype)
    return o
