"""Dense projections of one decode token as a Triton GEMV (DESIGN.md §6).

One program per block of output rows streams its rows once, as the MoE GEMV kernels do (ops/moe_gemv.py).
Measured on an H200 against cuBLAS at the 48B shapes (benchmarks/gpu_kernels.py --only gemv, 2026-11-30):
1.15x on the lm_head (755 MB, 4.4 TB/s), on a par for the KDA and MLA input projections, 0.6-0.8x where
the output has few rows and a long input (the attention output 2304 x 4096, where cuBLAS splits K). So
`linear` uses it only for the shapes listed in CONFIGS. Tokens after the first re-read the weight tile
from cache: single-token steps only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from hyserve.ops.dispatch import no_grad_fast_path
from hyserve.ops.moe_gemv import _gemv_rows

# (BLOCK_N rows, BLOCK_K, num_warps, num_stages) by weight shape (out, in), for the shapes where a sweep on
# an H200 (benchmarks/gpu_kernels.py --only gemv) beat cuBLAS; `linear` keeps cuBLAS for every other shape
CONFIGS: dict[tuple[int, int], tuple[int, int, int, int]] = {
    (163840, 2304): (16, 256, 8, 4),  # the 48B lm_head: 172 µs = 4.4 TB/s against cuBLAS's 197 µs (2026-11-30)
}
DEFAULT = (16, 256, 4, 4)


@triton.jit
def _dense_gemv_kernel(x_ptr, s_xm, w_ptr, s_wr, y_ptr, s_ym, N, K, T, BN: tl.constexpr, BK: tl.constexpr):
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    rmask = rows < N
    for t in range(T):
        acc = _gemv_rows(w_ptr, 0, s_wr, rows, rmask, x_ptr + t * s_xm, K, False, BN, BK)
        tl.store(y_ptr + t * s_ym + rows, acc.to(y_ptr.dtype.element_ty), mask=rmask)


def gemv(x: torch.Tensor, weight: torch.Tensor, config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """x [T, K] @ weight[N, K]ᵀ -> [T, N] in x's dtype, fp32 accumulation."""
    t, k = x.shape
    n = weight.shape[0]
    x = x if x.stride(-1) == 1 else x.contiguous()
    assert weight.stride(-1) == 1 and weight.shape[1] == k
    y = torch.empty(t, n, dtype=x.dtype, device=x.device)
    bn, bk, warps, stages = config or CONFIGS.get((n, k), DEFAULT)
    if t:
        _dense_gemv_kernel[(triton.cdiv(n, bn),)](
            x, x.stride(0), weight, weight.stride(0), y, y.stride(0), n, k, t, BN=bn, BK=bk, num_warps=warps,
            num_stages=stages,
        )
    return y


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.linear without bias; a single token on the GPU fast path goes through `gemv` (no autograd) where
    the weight's shape has a measured config."""
    if (x.dim() == 2 and x.shape[0] == 1 and tuple(weight.shape) in CONFIGS and x.dtype == weight.dtype
            and x.dtype in (torch.bfloat16, torch.float16) and no_grad_fast_path(x, weight)):
        return gemv(x, weight)
    return F.linear(x, weight)
