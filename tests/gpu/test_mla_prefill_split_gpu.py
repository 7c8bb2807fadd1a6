"""MLA prefill of a chunk over a cached context split into the context (unmasked) and the chunk (causal),
two cuDNN calls merged by log-sum-exp (`ops/mla_decode.attention_split`), against the one lower-right
causal SDPA call it replaces, in bf16 at the 48B shape (32 heads, q/k 192 wide, v 128)."""

from __future__ import annotations

import pytest
import torch
from test_mla_moe_gpu import DN, DR, DV, H, R, _pages  # the same 48B head shape and paged pool

from hyserve.ops.mla_decode import (
    SPLIT_MIN_ROWS,
    cudnn_attention_lse,
    cudnn_split_mode,
    merge_attention,
    merge_attention_triton,
    mla_prefill_fast,
    reference_attention_lse,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    assert torch.isfinite(a).all(), "non-finite values in the fast result"
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _inputs(ql: list[int], cl: list[int], seed: int):
    """Pages holding every sequence's context in shuffled blocks, the up-projection and the queries."""
    gen = torch.Generator("cuda").manual_seed(seed)
    pages, bt = _pages(cl, gen)
    kvb = (torch.randn(H * (DN + DV), R, device="cuda", generator=gen) * 0.05).to(torch.bfloat16)
    qn = torch.randn(sum(ql), H, DN, device="cuda", generator=gen).to(torch.bfloat16)
    qr = torch.randn(sum(ql), H, DR, device="cuda", generator=gen).to(torch.bfloat16)
    return qn, qr, pages, bt, kvb


def _heads_first(t: int, d: int, gen: torch.Generator) -> torch.Tensor:
    """[1, H, t, d] bf16 as the prefill makes it: a view of a [t, H, d] tensor."""
    return torch.randn(t, H, d, device="cuda", generator=gen).to(torch.bfloat16).transpose(0, 1).unsqueeze(0)


def _mode_at_the_48b_shape() -> str | None:
    """`cudnn_split_mode` for q, k and v laid out as `mla_prefill_fast` makes them (v a view of kv)."""
    gen = torch.Generator("cuda").manual_seed(0)
    q, k = torch.randn(2, 256, H, DN + DR, device="cuda", generator=gen).to(torch.bfloat16)
    kv = torch.randn(256, H, DN + DV, device="cuda", generator=gen).to(torch.bfloat16)
    return cudnn_split_mode(q, k, kv[..., DN:])


@pytest.mark.skipif(not HOPPER, reason="measured on Hopper")
def test_cudnn_serves_the_split_at_the_48b_shape_on_hopper():
    assert _mode_at_the_48b_shape() in ("narrow", "padded")


def test_fp32_inputs_fall_back_to_the_single_lower_right_call():
    q, k, v = torch.randn(3, 256, 4, 64, device="cuda")
    assert cudnn_split_mode(q, k, v) is None


@pytest.mark.skipif(not HOPPER, reason="measured on Hopper")
@pytest.mark.parametrize("causal", [False, True], ids=["unmasked", "causal"])
def test_cudnn_log_sum_exp_is_the_natural_log_sum_exp_of_the_scaled_scores(causal):
    d_v = DV if _mode_at_the_48b_shape() == "narrow" else DN + DR
    gen = torch.Generator("cuda").manual_seed(1)
    nq, nk = (300, 300) if causal else (300, 1000)
    q, k, v = _heads_first(nq, DN + DR, gen), _heads_first(nk, DN + DR, gen), _heads_first(nk, d_v, gen)
    scale = (DN + DR) ** -0.5
    o, lse = cudnn_attention_lse(q, k, v, causal, scale)
    o_ref, lse_ref = reference_attention_lse(q, k, v, causal, scale)
    assert o.shape == (1, H, nq, d_v)
    assert lse.shape == (1, H, nq) and lse.dtype == torch.float32
    torch.testing.assert_close(lse, lse_ref, rtol=1e-3, atol=1e-2)
    assert rel_err(o, o_ref) < 1e-2


@pytest.mark.parametrize("ql,cl", [([2049], [12288]), ([8192], [16384]), ([7, 300, 1, 64, 5, 64], [7, 1300, 65, 64, 45, 128])],
                         ids=["2049-over-12288", "8192-over-16384", "small-mixed"])
def test_split_prefill_matches_the_single_lower_right_call(ql, cl, monkeypatch):
    """The small step mixes fresh prompts (one causal call either way), chunks too short to split (one of a
    single token) and chunks split: 300 over 1000 cached rows, 64 over 64 (the smallest split). Every chunk
    of SPLIT_MIN_ROWS splits here, not only those of SPLIT_MIN_QUERIES (the serving default)."""
    monkeypatch.setattr("hyserve.ops.mla_decode.SPLIT_MIN_QUERIES", SPLIT_MIN_ROWS)
    qn, qr, pages, bt, kvb = _inputs(ql, cl, len(ql))
    scale = (DN + DR) ** -0.5
    single = mla_prefill_fast(qn, qr, pages, 1, bt, ql, cl, kvb, R, DV, scale, split=False)
    split = mla_prefill_fast(qn, qr, pages, 1, bt, ql, cl, kvb, R, DV, scale)
    q0 = 0
    for i, nq in enumerate(ql):
        assert rel_err(split[q0 : q0 + nq], single[q0 : q0 + nq]) < 1e-2, i
        q0 += nq


def test_triton_merge_of_bf16_parts_matches_the_torch_merge():
    """Parts sliced from 192-wide (padded-v) outputs, merged into the [L, H, d_v] output as the prefill does."""
    gen = torch.Generator("cuda").manual_seed(2)
    n = 2049
    o_a, o_b = _heads_first(n, DN + DR, gen)[..., :DV], _heads_first(n, DN + DR, gen)[..., :DV]
    lse_a, lse_b = (torch.randn(2, 1, H, n, device="cuda", generator=gen) * 5).unbind(0)
    out = torch.empty(n, H, DV, device="cuda", dtype=torch.bfloat16)
    merge_attention_triton(o_a, lse_a, o_b, lse_b, out=out.transpose(0, 1).unsqueeze(0))
    want = merge_attention(o_a, lse_a, o_b, lse_b)[0].transpose(0, 1)
    torch.testing.assert_close(out.float(), want.float(), rtol=2**-7, atol=1e-6)


@pytest.mark.parametrize("n", [1023, 1024, 3000])
def test_fresh_prompt_on_the_length_ladder_equals_its_unpadded_causal_call(n):
    """The appended rows of `ops.mla_fresh` (a 1,023-token prompt run as 1,024 rows) change no real row
    under the causal mask, with SDPA's CUDA kernels on both sides."""
    from hyserve.ops.mla_fresh import fresh_attention, fresh_len, pads_fresh

    assert pads_fresh(torch.empty(0, device="cuda")), "cuDNN SDPA is off: fresh prompts would not take the ladder"
    gen = torch.Generator("cuda").manual_seed(n)
    q, k, v = (torch.randn(n, H, DN + DR, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(3))
    got = fresh_attention(q, k, v, (DN + DR) ** -0.5)
    want = fresh_attention(q, k, v, (DN + DR) ** -0.5, rows=n)
    assert fresh_len(n) % 256 == 0 and got.shape == want.shape
    assert rel_err(got, want) < 1e-2


@pytest.mark.parametrize("ql,cl,max_rows", [([2048], [40960], 16384), ([512, 3, 300], [20000, 9000, 300], 8192)],
                         ids=["2048-over-38912-in-16384-row-pieces", "mixed-in-8192-row-groups"])
def test_a_bounded_prefill_matches_the_prefill_that_expands_every_row_at_once(ql, cl, max_rows):
    """A long context attended piece by piece (cuDNN with its log-sum-exp, merged in fp32), and sequences
    expanded in groups, against the whole context expanded at once."""
    qn, qr, pages, bt, kvb = _inputs(ql, cl, 7)
    scale = (DN + DR) ** -0.5
    whole = mla_prefill_fast(qn, qr, pages, 1, bt, ql, cl, kvb, R, DV, scale, max_rows=sum(cl))
    bounded = mla_prefill_fast(qn, qr, pages, 1, bt, ql, cl, kvb, R, DV, scale, max_rows=max_rows)
    q0 = 0
    for i, nq in enumerate(ql):
        assert rel_err(bounded[q0 : q0 + nq], whole[q0 : q0 + nq]) < 1e-2, i
        q0 += nq


@pytest.mark.skipif(not HOPPER, reason="measured on Hopper")
def test_a_bounded_prefill_over_a_long_context_allocates_a_piece_not_the_context():
    ql, cl, max_rows = [1024], [131072], 16384
    qn, qr, pages, bt, kvb = _inputs(ql, cl, 8)
    scale = (DN + DR) ** -0.5
    peaks = []
    for rows in (max_rows, sum(cl)):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        mla_prefill_fast(qn, qr, pages, 1, bt, ql, cl, kvb, R, DV, scale, max_rows=rows)
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - base)
    per_row = H * (2 * (DN + DV) + 2 * (DN + DR)) * 2  # kv, k and at most two value forms, bf16
    assert peaks[0] < 2 * max_rows * per_row < peaks[1]
