"""RMSNorm in one Triton kernel (docs/ARCHITECTURE.md §7; reference: models/layers/norm.rms_norm).

The torch form is about eight kernels (cast, square, mean, add, rsqrt, multiply, cast, scale), and a
decode step of the 48B shape runs 62 norms: a tenth of the step's launches. One program per row does the
same arithmetic in one pass: sum of squares in fp32, x * rsqrt(mean + eps) cast to the input dtype,
then the weight (cast to that dtype) times it, rounded once as torch's elementwise multiply rounds. Only
the order of the fp32 sum differs from the reference.

With a residual the same program first adds the layer's output to the residual stream, rounds the sum
to the stream's dtype as torch's add does, and stores it: the 54 residual adds of a 48B decode step
stop being launches of their own. A decode MoE's output may arrive as its fp32 per-pair partials
(ops/moe_gemv.PairParts): the program sums them in pair order and rounds the sum to the stream's dtype,
as the pair-sum kernel would have, so that kernel is not launched (one graph node fewer per MoE layer).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hyserve.ops.dispatch import use_pdl

# programmatic dependent launch on sm_90+ (off: plain launches, to compare against)
PDL = True


@triton.jit
def _rms_norm_kernel(
    x_ptr, w_ptr, out_ptr, s_x, s_o, n, eps, d_ptr, sum_ptr, s_d, s_s, BLOCK: tl.constexpr, RESIDUAL: tl.constexpr,
    PAIRS: tl.constexpr, PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    m = c < n
    dt = out_ptr.dtype.element_ty
    if PDL:  # launched while the kernel before it runs: wait for it before any read (the weight too: a
        # caller may pass one that kernel writes); the kernel after this one may launch now
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    w = tl.load(w_ptr + c, mask=m, other=0.0).to(dt).to(tl.float32)
    x = tl.load(x_ptr + row * s_x + c, mask=m, other=0.0).to(tl.float32)
    if RESIDUAL:  # x + delta, rounded to the stream's dtype, is both the new stream and the norm's input
        if PAIRS == 1:
            x += tl.load(d_ptr + row * s_d + c, mask=m, other=0.0).to(tl.float32)
        else:  # the delta is the sum of PAIRS fp32 rows, in order, rounded to the stream's dtype
            acc = tl.zeros([BLOCK], tl.float32)
            for j in tl.static_range(PAIRS):
                acc += tl.load(d_ptr + (row * PAIRS + j) * s_d + c, mask=m, other=0.0)
            x += acc.to(sum_ptr.dtype.element_ty).to(tl.float32)
        x = x.to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * s_s + c, x, mask=m)
        x = x.to(tl.float32)
    r = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n + eps)
    y = (x * r).to(dt).to(tl.float32)
    tl.store(out_ptr + row * s_o + c, (w * y).to(dt), mask=m)


def _rows(x: torch.Tensor, d: int) -> torch.Tensor:
    rows = x.reshape(-1, d)
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def rms_norm_fast(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual_delta: torch.Tensor | None = None,
    delta_pairs: int = 1, pdl: bool | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] (any float dtype, last dim contiguous or made so), weight [D] -> x's shape and dtype.
    With residual_delta (x's shape) returns (x + residual_delta, the norm of that sum) instead.
    delta_pairs > 1: residual_delta is fp32 [T·pairs, D] for x [T, D], each row's delta the sum of its
    pairs in order, rounded to x's dtype. pdl (default: `PDL` on a GPU of compute capability 9+): launch
    as a programmatic dependent of the kernel before it, and let the kernel after it launch early."""
    d = x.shape[-1]
    if weight.shape != (d,):
        raise ValueError(f"RMSNorm weight has shape {tuple(weight.shape)}, the input's last dim is {d}")
    rows = _rows(x, d)
    out = torch.empty_like(rows)
    if residual_delta is None:
        delta = total = rows  # unused: RESIDUAL is off
    else:
        want = (rows.shape[0] * delta_pairs, d) if delta_pairs > 1 else x.shape
        if residual_delta.shape != want or (delta_pairs > 1 and residual_delta.dtype != torch.float32):
            raise ValueError(f"residual delta has shape {tuple(residual_delta.shape)}, the input {tuple(x.shape)}")
        delta, total = _rows(residual_delta, d), torch.empty_like(rows)
    pdl = use_pdl(x, pdl, PDL)
    if rows.shape[0]:
        block = triton.next_power_of_2(d)
        _rms_norm_kernel[(rows.shape[0],)](
            rows, weight, out, rows.stride(0), out.stride(0), d, eps, delta, total, delta.stride(0),
            total.stride(0), BLOCK=block, RESIDUAL=residual_delta is not None, PAIRS=delta_pairs, PDL=pdl,
            num_warps=min(16, max(1, block // 256)), **({"launch_pdl": True} if pdl else {}),
        )
    if residual_delta is None:
        return out.view(x.shape)
    return total.view(x.shape), out.view(x.shape)
