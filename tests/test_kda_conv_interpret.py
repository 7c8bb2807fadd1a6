"""The prefill short-conv kernel (hyserve/ops/kda_conv.py) run by Triton's CPU interpreter against the torch
version it replaces on the GPU (ops/kda_prefill.causal_conv_varlen), which tests/test_kda_*.py and the
model tests hold to the reference."""

from __future__ import annotations

import importlib

import pytest
import torch
from interpret_util import INTERPRETED

from hyserve.ops.kda_prefill import causal_conv_varlen

pytestmark = INTERPRETED

C, W = 48, 4


@pytest.fixture(scope="module")
def conv():
    return importlib.import_module("hyserve.ops.kda_conv")


def _case(lens: list[int], seed: int, dtype=torch.float32, fresh=None):
    gen = torch.Generator().manual_seed(seed)
    t, n = sum(lens), len(lens)
    x = torch.randn(t, C, generator=gen).to(dtype)
    weight = torch.randn(C, W, generator=gen)
    tails = torch.randn(n, C, W - 1, generator=gen).to(dtype)
    if fresh is not None:
        tails = tails.masked_fill(torch.tensor(fresh)[:, None, None], 0)
    return x, weight, torch.tensor([0, *lens]).cumsum(0), tails


@pytest.mark.parametrize("lens", [[1], [2, 1, 5], [3, 40, 1, 2, 70]], ids=["one-token", "shorter-than-tail", "mixed"])
def test_the_kernel_matches_the_torch_conv(conv, lens):
    x, weight, cu, tails = _case(lens, len(lens))
    y, new_tails = conv.causal_conv_varlen_triton(x, weight, cu, tails, block_t=16, block_c=32)
    y_ref, tails_ref = causal_conv_varlen(x, weight, cu, tails)
    torch.testing.assert_close(y, y_ref, rtol=1e-6, atol=1e-6)
    assert torch.equal(new_tails, tails_ref)


def test_fresh_sequences_see_zero_tails(conv):
    x, weight, cu, tails = _case([5, 6], 7, fresh=[True, False])
    y, _ = conv.causal_conv_varlen_triton(x, weight, cu, tails, block_t=16, block_c=32)
    torch.testing.assert_close(y, causal_conv_varlen(x, weight, cu, tails)[0], rtol=1e-6, atol=1e-6)


def test_half_inputs_round_as_the_torch_conv(conv):
    x, weight, cu, tails = _case([4, 9], 8, dtype=torch.float16)
    y, new_tails = conv.causal_conv_varlen_triton(x, weight, cu, tails, block_t=16, block_c=32)
    y_ref, tails_ref = causal_conv_varlen(x, weight, cu, tails)
    assert y.dtype == torch.float16
    torch.testing.assert_close(y, y_ref, rtol=1e-3, atol=1e-3)
    assert torch.equal(new_tails, tails_ref)


def test_new_tails_alone_match_the_torch_conv():
    from hyserve.ops.kda_conv import new_conv_tails

    x, weight, cu, tails = _case([1, 2, 3, 8], 9)
    assert torch.equal(new_conv_tails(x, cu, tails), causal_conv_varlen(x, weight, cu, tails)[1])
