"""The sampler's compiled kernels on the GPU against their torch references (skips without CUDA)."""

from __future__ import annotations

import pytest
import torch

from hyserve.ops.argmax import argmax_rows

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("n", [1, 5, 64])
def test_argmax_equals_torch_argmax_over_the_48b_vocabulary(n):
    x = torch.randn(n, 163840, device="cuda", generator=torch.Generator(device="cuda").manual_seed(n))
    x[0, [100, 90000]] = 50.0  # a tie across slices: the first index
    if n > 1:
        x[1, 7] = float("nan")
        x[1, 8] = float("inf")
        x[-1] = float("-inf")
    got = argmax_rows(x)
    assert got.dtype == torch.long
    assert torch.equal(got, x.argmax(dim=-1))
    assert got[0].item() == 100


def test_argmax_of_a_bf16_row_view_equals_torch():
    x = torch.randn(8, 163840, device="cuda", generator=torch.Generator(device="cuda").manual_seed(3)).bfloat16()
    assert torch.equal(argmax_rows(x[::2]), x[::2].argmax(dim=-1))
