"""The KDA output norm of a prefill step as one Triton kernel (docs/ARCHITECTURE.md §7; reference:
`norm.gated_rms_norm`): weight · o / rms(o) · sigmoid(gate) per (token, head) row of K values, fp32
throughout, cast once to the model dtype.

A program takes a tile of BR (token, head) rows: at 8K tokens of the 48B shape one program per row
(262,144 programs of 128 values, as the decode finish kernel is shaped) ran at 26% of copy bandwidth.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gated_norm_rows_kernel(o_ptr, gate_ptr, s_gt, w_ptr, out_ptr, s_ot, R, H, eps,
                            K: tl.constexpr, BR: tl.constexpr):
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    rm = r < R
    t = (r // H).to(tl.int64)
    h = r % H
    c = tl.arange(0, K)
    m = rm[:, None]
    o = tl.load(o_ptr + r.to(tl.int64)[:, None] * K + c[None, :], mask=m, other=0.0).to(tl.float32)
    g = tl.load(gate_ptr + t[:, None] * s_gt + (h * K)[:, None] + c[None, :], mask=m, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + c).to(tl.float32)
    y = o * tl.rsqrt(tl.sum(o * o, axis=1) / K + eps)[:, None] * w[None, :] * tl.sigmoid(g)
    tl.store(out_ptr + t[:, None] * s_ot + (h * K)[:, None] + c[None, :], y.to(out_ptr.dtype.element_ty), mask=m)


def gated_rms_norm_rows(o: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                        dtype: torch.dtype, block_rows: int = 32, num_warps: int = 4) -> torch.Tensor:
    """o [T, H, K] (contiguous), gate logits [T, H*K] (unit stride in the last dim), weight [K] ->
    `gated_rms_norm(o, gate.view(T, H, K), weight, eps)` as [T, H*K] in dtype. K a power of two."""
    t, h, k = o.shape
    assert o.is_contiguous() and gate.stride(-1) == 1 and gate.shape == (t, h * k)
    out = torch.empty(t, h * k, dtype=dtype, device=o.device)
    if t:
        _gated_norm_rows_kernel[(triton.cdiv(t * h, block_rows),)](
            o, gate, gate.stride(0), weight, out, out.stride(0), t * h, h, eps, K=k, BR=block_rows,
            num_warps=num_warps,
        )
    return out
