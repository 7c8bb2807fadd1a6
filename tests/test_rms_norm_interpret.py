"""The fused RMSNorm kernel (hyserve/ops/rms_norm.py) run by Triton's CPU interpreter against the torch
reference (models/layers/norm.rms_norm, spec/models.md §1.4). TRITON_INTERPRET=1 must be set before
triton is imported (tests/conftest.py does it without CUDA); tests/gpu/test_rms_norm_gpu.py checks the
compiled kernel."""

from __future__ import annotations

import importlib
import importlib.util

import pytest
import torch
from interpret_util import INTERPRETED

from hyserve.models.layers.norm import rms_norm

pytestmark = INTERPRETED


@pytest.fixture(scope="module")
def fast():
    return importlib.import_module("hyserve.ops.rms_norm").rms_norm_fast


def test_fp32_rows_match_the_reference(fast):
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(7, 48, generator=gen) * 3, torch.randn(48, generator=gen)
    torch.testing.assert_close(fast(x, w, 1e-5), rms_norm(x, w, 1e-5), rtol=1e-6, atol=1e-6)


def test_fp16_rows_round_like_the_reference(fast):
    """fp32 statistics, cast to the input dtype, scaled by the weight in that dtype: a different fp32 sum
    order can move the first rounding by one step and the weight's product by one more; nearly all
    elements are equal. (fp16 here: the interpreter truncates bf16 casts; the GPU test checks bf16.)"""
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(5, 300, generator=gen) * 4).to(torch.float16)
    w = (1 + 0.2 * torch.randn(300, generator=gen)).to(torch.float16)
    got, ref = fast(x, w, 1e-6), rms_norm(x, w, 1e-6)
    assert got.dtype == torch.float16
    torch.testing.assert_close(got, ref, rtol=2e-3, atol=2e-3)  # two fp16 steps
    assert (got == ref).float().mean() > 0.99


def test_strided_rows_and_leading_dims_keep_their_shape(fast):
    """A column slice of a wider tensor (rows not contiguous with each other), 3-D, odd width."""
    gen = torch.Generator().manual_seed(2)
    wide = torch.randn(2, 3, 70, generator=gen)
    x, w = wide[..., 5:42], torch.randn(37, generator=gen)
    got = fast(x, w, 1e-5)
    assert got.shape == (2, 3, 37)
    torch.testing.assert_close(got, rms_norm(x, w, 1e-5), rtol=1e-6, atol=1e-6)


def test_no_rows_give_an_empty_result(fast):
    assert fast(torch.zeros(0, 16), torch.ones(16), 1e-5).shape == (0, 16)


def test_a_weight_of_the_wrong_width_is_refused(fast):
    with pytest.raises(ValueError, match="last dim is 16"):
        fast(torch.zeros(2, 16), torch.ones(8), 1e-5)


def test_residual_add_returns_the_rounded_sum_and_its_norm(fast):
    """The fused residual add: the sum rounded to the stream's dtype exactly as torch's add rounds it,
    then the norm of that sum."""
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(4, 200, generator=gen) * 4).to(torch.float16)
    d = (torch.randn(4, 200, generator=gen) * 4).to(torch.float16)
    w = (1 + 0.2 * torch.randn(200, generator=gen)).to(torch.float16)
    total, normed = fast(x, w, 1e-6, residual_delta=d)
    assert torch.equal(total, x + d)
    torch.testing.assert_close(normed, rms_norm(x + d, w, 1e-6), rtol=2e-3, atol=2e-3)


def test_residual_of_another_shape_is_refused(fast):
    with pytest.raises(ValueError, match="residual delta"):
        fast(torch.ones(2, 8), torch.ones(8), 1e-6, residual_delta=torch.ones(3, 8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_pair_partials_give_what_the_pair_sum_then_the_add_give_bit_for_bit(fast, dtype):
    """A decode MoE's unsummed fp32 per-pair outputs: the kernel sums each row's pairs in order and rounds
    the sum to the stream's dtype as the pair-sum kernel does, then adds and normalises as with the summed
    delta (the pair-sum kernel itself is the reference)."""
    from hyserve.ops.moe_gemv import sum_pairs

    gen = torch.Generator().manual_seed(3)
    t, pairs, d = 3, 9, 40
    x, w = (torch.randn(t, d, generator=gen) * 2).to(dtype), torch.randn(d, generator=gen).to(dtype)
    part = torch.randn(t * pairs, d, generator=gen)
    want_sum, want = fast(x, w, 1e-6, residual_delta=sum_pairs(part, pairs, dtype))
    got_sum, got = fast(x, w, 1e-6, residual_delta=part, delta_pairs=pairs)
    assert torch.equal(got_sum, want_sum) and torch.equal(got, want)


def test_pair_partials_of_the_wrong_shape_are_refused(fast):
    with pytest.raises(ValueError, match="residual delta"):
        fast(torch.zeros(2, 16), torch.ones(16), 1e-5, residual_delta=torch.zeros(5, 16), delta_pairs=3)
