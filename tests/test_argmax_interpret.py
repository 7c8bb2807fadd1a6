"""The greedy argmax kernels (hyserve/ops/argmax.py) run by Triton's CPU interpreter against torch.argmax;
tests/gpu/test_sampler_gpu.py checks the compiled kernels at the 48B vocabulary."""

from __future__ import annotations

import pytest
import torch
from interpret_util import INTERPRETED

from hyserve.ops.argmax import BLOCK, argmax_triton

pytestmark = INTERPRETED


@pytest.mark.parametrize("v", [1, 7, BLOCK, 2 * BLOCK + 5])
def test_argmax_matches_torch_on_random_rows(v):
    x = torch.randn(3, v, generator=torch.Generator().manual_seed(v))
    assert torch.equal(argmax_triton(x), x.argmax(dim=-1))


def test_argmax_ties_go_to_the_first_index_across_slices():
    x = torch.zeros(2, 2 * BLOCK + 5)
    x[0, [BLOCK + 3, 5, 2 * BLOCK + 1]] = 4.0
    x[1] = float("-inf")  # all masked: index 0, as torch
    assert argmax_triton(x).tolist() == [5, 0] == x.argmax(dim=-1).tolist()


def test_argmax_counts_nan_above_infinity_as_torch_does():
    x = torch.randn(2, 2 * BLOCK + 5, generator=torch.Generator().manual_seed(1))
    x[0, 10] = float("inf")
    x[0, [BLOCK + 7, 2 * BLOCK]] = float("nan")
    x[1, 3] = float("inf")
    assert torch.equal(argmax_triton(x), x.argmax(dim=-1))
    assert argmax_triton(x).tolist() == [BLOCK + 7, 3]


def test_argmax_reads_a_strided_row_view():
    x = torch.randn(4, 2 * BLOCK, generator=torch.Generator().manual_seed(2))[::2, : BLOCK + 9]
    assert torch.equal(argmax_triton(x), x.argmax(dim=-1))
