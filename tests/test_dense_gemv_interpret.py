"""The single-token projection GEMV (hyserve/ops/dense_gemv.py) run by Triton's CPU interpreter in fp32
against F.linear; tests/gpu/test_mla_moe_gpu.py checks the compiled kernel in bf16."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F
from interpret_util import INTERPRETED

pytestmark = INTERPRETED


@pytest.mark.parametrize("t,n,k", [(1, 40, 72), (3, 16, 32), (1, 7, 300)])
def test_gemv_equals_linear_for_ragged_row_and_column_blocks(t, n, k):
    gemv = importlib.import_module("hyserve.ops.dense_gemv").gemv
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(t, k + 5, generator=gen)[:, :k]  # a strided view, as a split of a merged GEMM
    w = torch.randn(n, k, generator=gen)
    torch.testing.assert_close(gemv(x, w, (16, 32, 4, 2, 1)), F.linear(x, w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("t,n,k,split", [(1, 40, 300, 3), (2, 16, 128, 2), (1, 33, 64, 4)])
def test_split_k_sums_its_parts_and_leaves_the_counters_zero(t, n, k, split):
    """Splits of whole column blocks (the last one short or empty of a block), summed by the last split of
    each row block to arrive; a second call on the same counters gives the same result."""
    from hyserve.ops.arrival import arrival_counters

    gemv = importlib.import_module("hyserve.ops.dense_gemv").gemv
    gen = torch.Generator().manual_seed(k)
    x, w = torch.randn(t, k, generator=gen), torch.randn(n, k, generator=gen)
    first = gemv(x, w, (16, 32, 4, 2, split))
    torch.testing.assert_close(first, F.linear(x, w), rtol=1e-5, atol=1e-5)
    assert int(arrival_counters("cpu", 1).count_nonzero()) == 0
    assert torch.equal(gemv(x, w, (16, 32, 4, 2, split)), first)


@pytest.mark.parametrize("split", [1, 3])
def test_silu_glu_gemv_applies_the_glu_to_gate_and_up_halves(split):
    """x holds gate | up; the product is with the GLU of the two halves, split or not (each split reads its
    columns of both halves)."""
    from hyserve.models.layers.activation import GLU

    gemv = importlib.import_module("hyserve.ops.dense_gemv").gemv
    gen = torch.Generator().manual_seed(split)
    x, w = torch.randn(1, 2 * 200, generator=gen), torch.randn(24, 200, generator=gen)
    expected = F.linear(GLU("silu")(x[:, :200], x[:, 200:]), w)
    torch.testing.assert_close(gemv(x, w, (16, 32, 4, 2, split), silu_glu=True), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("split", [1, 3])
def test_an_fp32_out_holds_the_products_rounded_to_the_input_dtype(split):
    """The logits buffer: the GEMV stores fp32 values equal to its fp16 result converted, bit for bit (no
    conversion kernel after it), split or not. (fp16: the interpreter truncates bf16 casts.)"""
    gemv = importlib.import_module("hyserve.ops.dense_gemv").gemv
    gen = torch.Generator().manual_seed(10 + split)
    x, w = torch.randn(2, 96, generator=gen).half(), torch.randn(40, 96, generator=gen).half()
    out = torch.full((2, 40), float("nan"))
    got = gemv(x, w, (16, 32, 4, 2, split), out=out)
    assert got is out and torch.equal(out, gemv(x, w, (16, 32, 4, 2, split)).float())


@pytest.mark.parametrize("t,n,k,split", [(5, 40, 300, 1), (8, 16, 128, 2), (1, 33, 64, 3), (16, 24, 100, 4)])
def test_the_tokens_gemv_equals_linear_split_or_not(t, n, k, split):
    """A verify step's rows at once (the weight streamed once), ragged row and column blocks, K split or
    not, and the counters left zero for the next call."""
    from hyserve.ops.arrival import arrival_counters

    gemv_tokens = importlib.import_module("hyserve.ops.dense_gemv").gemv_tokens
    gen = torch.Generator().manual_seed(t * k)
    x = torch.randn(t, k + 3, generator=gen)[:, :k]  # a strided view, as a split of a merged GEMM
    w = torch.randn(n, k, generator=gen)
    first = gemv_tokens(x, w, (16, 32, 4, 2, split))
    torch.testing.assert_close(first, F.linear(x, w), rtol=1e-5, atol=1e-5)
    assert int(arrival_counters("cpu", 1).count_nonzero()) == 0
    assert torch.equal(gemv_tokens(x, w, (16, 32, 4, 2, split)), first)


def test_the_tokens_gemv_refuses_more_rows_than_one_dot_holds():
    dense_gemv = importlib.import_module("hyserve.ops.dense_gemv")
    x, w = torch.zeros(dense_gemv.TOKENS_MAX + 1, 32), torch.zeros(16, 32)
    with pytest.raises(ValueError, match="1 to 16 rows"):
        dense_gemv.gemv_tokens(x, w, (16, 32, 4, 2, 1))
