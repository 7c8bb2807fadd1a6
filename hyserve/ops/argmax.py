"""Greedy argmax over the vocabulary as two Triton launches (the sampler's last step of every decode).

torch.argmax reduces a row in one block of threads: 8.3 µs for one row of 163,840 fp32 logits on an H200,
the only kernel of a batch-1 step left outside its CUDA graph besides the copies. Here many programs each
reduce a slice of a row to its (max, first index), and one program per row picks among the slices.

Same result as torch.argmax, ties and NaN included: the first index of the maximum, and a NaN counts as
larger than everything (its first index wins).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096  # values a first-stage program reduces: 40 programs for 163,840 logits


@triton.jit
def _first_of_max(x, idx, BIG: tl.constexpr):
    """(max of x with NaN above everything, the first idx where it occurs): (value, is-NaN flag, index)."""
    nan = x != x
    any_nan = tl.max(nan.to(tl.int32), axis=0)
    m = tl.max(tl.where(nan, float("-inf"), x), axis=0)
    hit = tl.where(any_nan > 0, nan, x == m)
    return m, any_nan, tl.min(tl.where(hit, idx, BIG), axis=0)


@triton.jit
def _slice_kernel(x_ptr, s_xn, V, val_ptr, nan_ptr, idx_ptr, S, BLOCK: tl.constexpr):
    n = tl.program_id(0)
    s = tl.program_id(1)
    i = s * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + n * s_xn + i, mask=i < V, other=float("-inf")).to(tl.float32)
    m, any_nan, first = _first_of_max(x, i, 2147483647)
    tl.store(val_ptr + n * S + s, m)
    tl.store(nan_ptr + n * S + s, any_nan)
    tl.store(idx_ptr + n * S + s, first)


@triton.jit
def _pick_kernel(val_ptr, nan_ptr, idx_ptr, S, out_ptr, BS: tl.constexpr):
    n = tl.program_id(0)
    s = tl.arange(0, BS)
    live = s < S
    m = tl.load(val_ptr + n * S + s, mask=live, other=float("-inf"))
    nan = tl.load(nan_ptr + n * S + s, mask=live, other=0) > 0
    idx = tl.load(idx_ptr + n * S + s, mask=live, other=2147483647)
    # slices are in index order, so the first slice holding the maximum holds its first index
    best = tl.max(m, axis=0)
    hit = tl.where(tl.max(nan.to(tl.int32), axis=0) > 0, nan, live & (m == best))
    tl.store(out_ptr + n, tl.min(tl.where(hit, idx, 2147483647), axis=0).to(tl.int64))


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """argmax over the last dim of a 2-D tensor, int64 [N]; Triton on CUDA, torch.argmax elsewhere."""
    if not x.is_cuda or x.dim() != 2 or x.shape[0] == 0 or x.shape[1] >= 2**31 or x.stride(1) != 1:
        return x.argmax(dim=-1)
    return argmax_triton(x)


def argmax_triton(x: torch.Tensor) -> torch.Tensor:
    """The two launches for x [N, V] (last dim unit-stride, V < 2**31)."""
    n, v = x.shape
    s = triton.cdiv(v, BLOCK)
    val = torch.empty(n, s, dtype=torch.float32, device=x.device)
    nan = torch.empty(n, s, dtype=torch.int32, device=x.device)
    idx = torch.empty(n, s, dtype=torch.int32, device=x.device)
    out = torch.empty(n, dtype=torch.long, device=x.device)
    _slice_kernel[(n, s)](x, x.stride(0), v, val, nan, idx, s, BLOCK=BLOCK, num_warps=8)
    _pick_kernel[(n,)](val, nan, idx, s, out, BS=max(16, triton.next_power_of_2(s)), num_warps=1)
    return out
