"""RMSNorm in one Triton kernel (DESIGN.md §6; reference: models/layers/norm.rms_norm).

The torch form is about eight kernels (cast, square, mean, add, rsqrt, multiply, cast, scale), and a
decode step of the 48B shape runs 62 norms: a tenth of the step's launches. One program per row does the
same arithmetic in one pass: sum of squares in fp32, x * rsqrt(mean + eps) cast to the input dtype,
then the weight (cast to that dtype) times it, rounded once as torch's elementwise multiply rounds. Only
the order of the fp32 sum differs from the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, s_x, s_o, n, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    m = c < n
    x = tl.load(x_ptr + row * s_x + c, mask=m, other=0.0).to(tl.float32)
    r = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n + eps)
    dt = out_ptr.dtype.element_ty
    y = (x * r).to(dt).to(tl.float32)
    w = tl.load(w_ptr + c, mask=m, other=0.0).to(dt).to(tl.float32)
    tl.store(out_ptr + row * s_o + c, (w * y).to(dt), mask=m)


def rms_norm_fast(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D] (any float dtype, last dim contiguous or made so), weight [D] -> x's shape and dtype."""
    d = x.shape[-1]
    if weight.shape != (d,):
        raise ValueError(f"RMSNorm weight has shape {tuple(weight.shape)}, the input's last dim is {d}")
    rows = x.reshape(-1, d)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty_like(rows)
    if rows.shape[0]:
        block = triton.next_power_of_2(d)
        _rms_norm_kernel[(rows.shape[0],)](
            rows, weight, out, rows.stride(0), out.stride(0), d, eps, BLOCK=block,
            num_warps=min(16, max(1, block // 256)),
        )
    return out.view(x.shape)
