"""The batched MLA prefill of the GPU path (`ops/mla_decode.mla_prefill_fast`) against the expanded-form
reference, run on the CPU: chunks that start at 0 and chunks over a cached context (the causal diagonal
aligned to the chunk's end), several sequences laid end to end; with one lower-right SDPA call per chunk
and with the chunk split into its cached context and itself, merged by log-sum-exp."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from dsa_util import paged_pool
from torch.nn.attention.bias import causal_lower_right

from hyserve.ops import mla_attention as ref
from hyserve.ops.mla_decode import (
    attention_split,
    cudnn_split_mode,
    merge_attention,
    mla_prefill_fast,
    reference_attention_lse,
    split_plan,
)

H, DN, DR, DV, R, BS = 4, 16, 8, 16, 32, 8


def _prefill_case(ql: list[int], cl: list[int], seed: int = 1) -> tuple:
    """mla_prefill_fast's arguments for chunks of ql queries at the end of cl rows (layer 1 of the pool)."""
    gen = torch.Generator().manual_seed(seed)
    pages, bt = paged_pool(cl, R + DR, torch.float32, bs=BS)
    pages.normal_(generator=gen)
    kvb = torch.randn(H * (DN + DV), R, generator=gen) * 0.2
    qn, qr = torch.randn(sum(ql), H, DN, generator=gen), torch.randn(sum(ql), H, DR, generator=gen)
    return (qn, qr, pages, 1, bt, ql, cl, kvb, R, DV, (DN + DR) ** -0.5)


def _assert_matches_reference(out: torch.Tensor, args: tuple) -> None:
    qn, qr, pages, layer, bt, ql, cl, kvb, _, _, scale = args
    q0 = 0
    for i, (nq, nc) in enumerate(zip(ql, cl)):
        rows = ref.gather_rows(pages, layer, bt[i], nc)
        want = ref.mla_expanded(qn[q0 : q0 + nq], qr[q0 : q0 + nq], rows, kvb, R, DV, scale, nc - nq)
        torch.testing.assert_close(out[q0 : q0 + nq], want, rtol=1e-4, atol=1e-5, msg=f"sequence {i}")
        q0 += nq


@pytest.mark.parametrize("split", [False, True], ids=["one-call", "split"])
def test_prefill_chunks_with_and_without_cached_context_match_the_reference(split):
    # from 0; over 35 cached rows; one token; over 24
    args = _prefill_case([13, 5, 1, 9], [13, 40, 17, 9 + 24], seed=0)
    _assert_matches_reference(mla_prefill_fast(*args, split=split), args)


def _qkv(nq: int, nc: int, d: int = 24, d_v: int = 16, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, H, nq, d, generator=gen)
    k, v = torch.randn(1, H, nc, d, generator=gen), torch.randn(1, H, nc, d_v, generator=gen)
    return q, k, v


@pytest.mark.parametrize("nq,nc", [(1, 1), (1, 30), (7, 7), (7, 9), (16, 40), (5, 700)],
                         ids=["one-token-prompt", "one-token-chunk", "prompt", "chunk-over-2", "chunk-over-24",
                              "chunk-over-695"])
def test_merged_split_equals_one_lower_right_causal_call(nq, nc):
    q, k, v = _qkv(nq, nc)
    scale = 24**-0.5
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(nq, nc), scale=scale)
    got = attention_split(q, k, v, scale, reference_attention_lse, v.shape[-1])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_merge_gives_a_part_without_keys_no_weight():
    q, k, v = _qkv(6, 10)
    scale = 24**-0.5
    o, lse = reference_attention_lse(q, k, v, False, scale)
    o_empty, lse_empty = reference_attention_lse(q, k[:, :, :0], v[:, :, :0], False, scale)
    assert torch.isneginf(lse_empty).all()
    torch.testing.assert_close(merge_attention(o_empty, lse_empty, o, lse), o, rtol=0, atol=0)
    torch.testing.assert_close(merge_attention(o, lse, o_empty, lse_empty), o, rtol=0, atol=0)


def test_merge_does_not_overflow_at_large_log_sum_exps():
    """Scores in the thousands: exp(lse) overflows fp32, the merge's weights must not."""
    q, k, v = _qkv(4, 12)
    q = q * 400.0
    scale = 24**-0.5
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(4, 12), scale=scale)
    got = attention_split(q, k, v, scale, reference_attention_lse, v.shape[-1])
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_merge_writes_into_a_strided_output_in_its_dtype():
    q, k, v = _qkv(5, 20)
    scale = 24**-0.5
    out = torch.zeros(5, H, 16, dtype=torch.float64)  # [L, H, d_v], written as [1, H, L, d_v]
    attention_split(q, k, v, scale, reference_attention_lse, 16, out=out.transpose(0, 1).unsqueeze(0))
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(5, 20), scale=scale)
    torch.testing.assert_close(out, want[0].transpose(0, 1).double(), rtol=1e-5, atol=1e-6)


def test_cpu_tensors_have_no_cudnn_split():
    q, k, v = torch.randn(8, H, 24), torch.randn(8, H, 24), torch.randn(8, H, 16)
    assert cudnn_split_mode(q, k, v) is None


def test_by_default_only_long_chunks_over_a_cached_context_split():
    # fresh prompts never; an agentic turn's few thousand new tokens not (a new shape would cost a cuDNN plan)
    ql, cl = [4096, 2049, 4096, 8192, 8192], [4096, 12288, 4096 + 63, 16384, 8192 + 64]
    assert split_plan(ql, cl, None) == [False, False, False, True, True]
    assert split_plan(ql, cl, False) == [False] * 5
    assert split_plan(ql, cl, True) == [False, True, True, True, True]


# a long chunk over 60 cached rows, short ones around it, a fresh prompt and a one-token tail
BOUNDED = ([13, 5, 1, 9, 20], [13, 65, 17, 9 + 24, 20 + 90])


@pytest.mark.parametrize("max_rows", [8, 16, 40, 64])
@pytest.mark.parametrize("split", [False, True], ids=["one-call", "split"])
def test_a_step_over_more_cached_rows_than_the_bound_matches_the_reference(max_rows, split):
    args = _prefill_case(*BOUNDED)
    _assert_matches_reference(mla_prefill_fast(*args, split=split, max_rows=max_rows), args)


@pytest.mark.parametrize("max_rows", [16, 40, 64])
def test_no_more_cached_rows_than_the_bound_or_a_chunk_are_expanded_at_once(monkeypatch, max_rows):
    from hyserve.ops import mla_decode

    expanded, expand = [], mla_decode._expand
    monkeypatch.setattr(mla_decode, "_expand", lambda pages, layer, page, *a: expanded.append(page.numel())
                        or expand(pages, layer, page, *a))
    mla_prefill_fast(*_prefill_case(*BOUNDED), max_rows=max_rows)
    # a chunk's own rows go at once (a chunk is at most the token budget): only the cached ones are bounded
    assert max(expanded) <= max(max_rows, *BOUNDED[0]) and sum(expanded) == sum(BOUNDED[1])


def test_a_step_within_the_bound_expands_its_rows_in_one_go(monkeypatch):
    from hyserve.ops import mla_decode

    expanded, expand = [], mla_decode._expand
    monkeypatch.setattr(mla_decode, "_expand", lambda pages, layer, page, *a: expanded.append(page.numel())
                        or expand(pages, layer, page, *a))
    mla_prefill_fast(*_prefill_case(*BOUNDED), max_rows=sum(BOUNDED[1]))
    assert expanded == [sum(BOUNDED[1])]
