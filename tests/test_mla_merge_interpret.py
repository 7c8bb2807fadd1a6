"""The Triton log-sum-exp merge of two attention parts (`ops/mla_decode.merge_attention_triton`, the CUDA
path of the split MLA prefill) run by Triton's CPU interpreter against the torch merge it replaces
(`merge_attention`, whose own tests check it against one lower-right causal call: tests/test_mla_prefill.py).
tests/gpu/test_mla_prefill_split_gpu.py runs the compiled kernel inside the split prefill."""

from __future__ import annotations

import importlib

import pytest
import torch
from interpret_util import INTERPRETED

pytestmark = INTERPRETED
H = 3


@pytest.fixture(scope="module")
def mla():
    return importlib.import_module("hyserve.ops.mla_decode")


def _parts(n: int, d: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    o_a, o_b = torch.randn(1, H, n, d, generator=gen), torch.randn(1, H, n, d, generator=gen)
    lse_a, lse_b = torch.randn(1, H, n, generator=gen) * 5, torch.randn(1, H, n, generator=gen) * 5
    return o_a, lse_a, o_b, lse_b


@pytest.mark.parametrize("n,d", [(1, 16), (45, 16), (70, 24)], ids=["one-query", "queries-past-a-block", "d-24"])
def test_triton_merge_equals_the_torch_merge(mla, n, d):
    parts = _parts(n, d)
    torch.testing.assert_close(mla.merge_attention_triton(*parts), mla.merge_attention(*parts), rtol=1e-6, atol=1e-6)


def test_triton_merge_writes_a_strided_output_and_reads_strided_parts(mla):
    """As the prefill calls it: parts sliced from wider (padded-v) outputs, the result into the [L, H, d]
    output seen as [1, H, L, d]."""
    o_a, lse_a, o_b, lse_b = _parts(40, 24)
    out = torch.zeros(40, H, 16)
    mla.merge_attention_triton(o_a[..., :16], lse_a, o_b[..., :16], lse_b, out=out.transpose(0, 1).unsqueeze(0))
    want = mla.merge_attention(o_a[..., :16], lse_a, o_b[..., :16], lse_b)
    torch.testing.assert_close(out, want[0].transpose(0, 1), rtol=1e-6, atol=1e-6)


def test_triton_merge_gives_a_part_with_lse_minus_infinity_no_weight(mla):
    o_a, lse_a, o_b, lse_b = _parts(20, 16)
    lse_a[:, 1] = float("-inf")
    got = mla.merge_attention_triton(o_a, lse_a, o_b, lse_b)
    torch.testing.assert_close(got[:, 1], o_b[:, 1], rtol=0, atol=0)
    torch.testing.assert_close(got, mla.merge_attention(o_a, lse_a, o_b, lse_b), rtol=1e-6, atol=1e-6)


def test_triton_merge_of_bf16_parts_is_the_fp32_merge_rounded_once(mla):
    """Within one bf16 step: the interpreter truncates fp32 to bf16 where the GPU rounds to nearest."""
    o_a, lse_a, o_b, lse_b = _parts(33, 16)
    o_a, o_b = o_a.bfloat16(), o_b.bfloat16()
    out = torch.empty(1, H, 33, 16, dtype=torch.bfloat16)
    mla.merge_attention_triton(o_a, lse_a, o_b, lse_b, out=out)
    want = mla.merge_attention(o_a.float(), lse_a, o_b.float(), lse_b)
    torch.testing.assert_close(out.float(), want, rtol=2**-7, atol=1e-6)
