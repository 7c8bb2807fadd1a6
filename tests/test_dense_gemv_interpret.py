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
    torch.testing.assert_close(gemv(x, w, (16, 32, 4, 2)), F.linear(x, w), rtol=1e-5, atol=1e-5)
