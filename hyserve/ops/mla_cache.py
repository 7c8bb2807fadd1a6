"""MLA's cache write as one Triton kernel (docs/ARCHITECTURE.md §7; reference: MLAttention.cache_rows and the page
store in models/layers/mla.py).

A token's cache row is [RMSNorm(c_kv) | k_rope] of the kv_a projection's output. In torch that is the
norm, a cat, the page/offset arithmetic of the slot mapping and an index store: five launches per MLA
layer and decode step. One program per token does the norm with the rounding of `rms_norm` and stores
the row into its page slot.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _cache_rows_kernel(ckv_ptr, s_ct, w_ptr, eps, slot_ptr, pages_ptr, s_pb, s_pr, BS,
                       R: tl.constexpr, DR: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    dst = pages_ptr + (slot // BS) * s_pb + (slot % BS) * s_pr
    c = tl.arange(0, R)
    x = tl.load(ckv_ptr + t * s_ct + c).to(tl.float32)
    dt = ckv_ptr.dtype.element_ty
    y = (x * (1.0 / tl.sqrt(tl.sum(x * x, axis=0) / R + eps))).to(dt).to(tl.float32)
    w = tl.load(w_ptr + c).to(dt).to(tl.float32)
    tl.store(dst + c, (w * y).to(dt))
    r = tl.arange(0, DR)
    tl.store(dst + R + r, tl.load(ckv_ptr + t * s_ct + R + r))


def write_cache_rows(ckv: torch.Tensor, norm_weight: torch.Tensor, eps: float, pages: torch.Tensor, layer: int,
                     slot_mapping: torch.Tensor) -> None:
    """ckv [T, R + d_r] (the kv_a projection) -> pages[slot // bs, layer, slot % bs] = [RMSNorm(c_kv) | k_rope].
    R and d_r powers of two; pages in ckv's dtype."""
    t, width = ckv.shape
    r = norm_weight.shape[0]
    assert ckv.stride(-1) == 1 and pages.stride(-1) == 1 and pages.dtype == ckv.dtype and pages.shape[-1] == width
    if t:
        view = pages[:, layer]
        _cache_rows_kernel[(t,)](
            ckv, ckv.stride(0), norm_weight, eps, slot_mapping, view, view.stride(0), view.stride(1), view.shape[1],
            R=r, DR=width - r, num_warps=4,
        )
