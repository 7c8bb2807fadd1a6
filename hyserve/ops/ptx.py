"""Inline PTX helpers shared by the Triton kernels. Compiled kernels only: the CPU interpreter cannot run
them, so callers gate them behind a constexpr that is off there."""

from __future__ import annotations

import triton
import triton.language as tl

# thread 0 issues the bulk L2 prefetch of [$1, $1 + $2); also used by the Gluon kernels, which cannot call
# a triton.jit function
PREFETCH_L2_ASM = tl.constexpr("{ .reg .pred p; .reg .b32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
                               "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }")


@triton.jit
def prefetch_l2(ptr, nbytes):
    """Thread 0 asks the copy engine to pull [ptr, ptr + nbytes) into L2 (16-byte aligned, a multiple of
    16 bytes); nothing waits for it. A hint: it never faults a program or changes a result."""
    tl.inline_asm_elementwise(PREFETCH_L2_ASM, "=r,l,r", [ptr, nbytes], dtype=tl.int32, is_pure=False, pack=1)
