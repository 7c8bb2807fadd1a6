"""The MLA layer's GPU path on a step with speculative verify rows at the 48B MLA shape on CUDA (bf16):
every verify token a decode-kernel row over the context up to its position, beside plain decodes and a
prefill chunk, against the layer's reference path (tests/test_mla_fast_verify_interpret.py runs the same
on the CPU under Triton's interpreter)."""

from __future__ import annotations

import pytest
import torch
from mla_step_util import layer_of, run, step_of

from hyserve.ops.kernel_plan import KernelPlan

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
# contexts of hundreds of rows over 64-row pages, verify rows of 5 and 8 tokens
STEP = [("verify", 5, 900), ("decode", 1, 77), ("verify", 8, 1300), ("decode", 1, 1)]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    assert torch.isfinite(a).all(), "non-finite values in the fast result"
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.mark.parametrize("layout", ["heads", "auto"])
@pytest.mark.parametrize("prefill", [False, True], ids=["verify+decode", "with-prefill"])
def test_verify_rows_on_the_decode_kernel_match_the_reference_at_the_48b_shape(layout, prefill, monkeypatch):
    layer = layer_of("kimi-linear-48b-a3b", 0, "cuda", torch.bfloat16)
    step = STEP[:2] + [("prefill", 300, 700)] + STEP[2:] if prefill else STEP
    x, batch, cache = step_of(layer, step, 1, block_size=64)
    ref, ref_pages, out, pages, calls = run(layer, x, batch, cache, monkeypatch,
                                            KernelPlan(mla="merged", mla_decode_layout=layout))
    assert calls["decode"] == [sum(q for kind, q, _ in step if kind != "prefill")]
    assert calls["prefill"] == ([300] if prefill else [])
    assert rel_err(out, ref) < 2e-2
    assert rel_err(pages, ref_pages) < 1e-2
