"""DSA GPU kernels (index scoring + top-k, sparse MLA) against the torch references at K3.1 sizes:
32 index heads × 128, top-2048, 64-token pages, contexts 4K-32K (spec/models.md §4.6, R1 contract)."""

from __future__ import annotations

import pytest
import torch
from dsa_util import assert_topk_sets_match, paged_pool, reference_scores, write_keys

from hyserve.ops import dsa_indexer as dsa
from hyserve.ops.sparse_mla import sparse_mla

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
HI, DI, TOPK, BS = 32, 128, 2048, 64
H, DN, DR, DV, R = 32, 128, 64, 128, 512


def index_case(fmt: str, query_lens: list[int], ctx: list[int], seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    pool, bt = paged_pool(ctx, dsa.key_record_bytes(fmt, DI), torch.uint8, seed=seed, device="cuda", bs=BS)
    keys = [torch.randn(c, DI, device="cuda", generator=gen).to(torch.bfloat16) for c in ctx]
    write_keys(pool, bt, 1, keys, fmt)
    t = sum(query_lens)
    q = torch.randn(t, HI, DI, device="cuda", generator=gen).to(torch.bfloat16)
    w = torch.randn(t, HI, device="cuda", generator=gen) * HI**-0.5
    positions = torch.cat([torch.arange(c - n, c, device="cuda") for n, c in zip(query_lens, ctx)])
    return pool, bt, q, w, positions


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
@pytest.mark.parametrize(
    "query_lens,ctx",
    [([1] * 4, [4096, 32768, 9000, 2049]), ([1, 300, 1], [32768, 6000, 5000])],
    ids=["decode", "decode+prefill-chunk"],
)
def test_index_topk_matches_r1(fmt, query_lens, ctx):
    from hyserve.ops.dsa_index_triton import index_topk_fast

    pool, bt, q, w, positions = index_case(fmt, query_lens, ctx)
    got = index_topk_fast(q, w, pool, 1, fmt, bt, query_lens, ctx, positions, TOPK)
    assert got.shape == (sum(query_lens), TOPK)
    at = 0
    for i, (n, c) in enumerate(zip(query_lens, ctx)):
        rows = range(at, at + n) if n <= 8 else [at, at + n // 2, at + n - 1]  # a few rows per prefill chunk
        for r in rows:
            scores = reference_scores(q[r : r + 1], w[r : r + 1], pool, bt, 1, fmt, i, c)
            assert_topk_sets_match(got[r : r + 1], scores, positions[r : r + 1], TOPK)
        at += n


def test_fp8_dot_scores_stay_within_the_r1_tolerance():
    """The FP8 tensor-core dot (the default on a GPU) against the exact fp16 dot: the same positions in
    every sort key, scores within 1e-3 (Hopper keeps fewer accumulator bits for e4m3 products)."""
    from hyserve.ops.dsa_index_triton import index_sort_keys, sort_key_scores

    pool, bt, q, w, positions = index_case("fp8", [1, 1, 1, 1], [4096, 32768, 9000, 2049])
    q8, wf = dsa.quantize_queries(q, w)
    exact, fp8 = (index_sort_keys(q8, wf, pool, 1, "fp8", bt, [1] * 4, positions, 32768, fp8_dot=x)
                  for x in (False, True))
    low = 0xFFFFFFFF
    assert torch.equal(exact & low, fp8 & low)
    a, b = sort_key_scores(fp8), sort_key_scores(exact)
    fin = torch.isfinite(b)
    assert torch.equal(fin, torch.isfinite(a))
    assert float((a - b)[fin].abs().max() / b[fin].abs().max()) < 1e-3


def test_equal_scores_select_the_lower_positions():
    from hyserve.ops.dsa_index_triton import index_topk_fast

    ctx = [8192]
    pool, bt = paged_pool(ctx, DI + 4, torch.uint8, device="cuda", bs=BS)
    write_keys(pool, bt, 1, [torch.ones(ctx[0], DI, device="cuda")], "fp8")
    q, w = torch.rand(1, HI, DI, device="cuda"), torch.rand(1, HI, device="cuda")
    got = index_topk_fast(q, w, pool, 1, "fp8", bt, [1], ctx, torch.tensor([ctx[0] - 1], device="cuda"), TOPK)
    assert torch.equal(got[0].cpu(), torch.arange(TOPK))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    assert torch.isfinite(a).all(), "non-finite values in the fast result"
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.mark.parametrize("heads", [H, 12, 96])
@pytest.mark.parametrize("page_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_sparse_mla_matches_reference(heads, page_dtype):
    """Same index sets (the indexer's, from a 32K context with decode and prefill rows) in both paths."""
    from hyserve.ops.sparse_mla_triton import sparse_mla_fast

    gen = torch.Generator(device="cuda").manual_seed(heads)
    ctx, query_lens = [32768, 4096, 20000], [1, 64, 1]
    pool, bt = paged_pool(ctx, R + DR, torch.float32, seed=1, device="cuda", bs=BS)
    pool.normal_(generator=gen)
    kv_scale = 0.02 if page_dtype == torch.float8_e4m3fn else 1.0
    pages = (pool / kv_scale).to(page_dtype)
    deq = pages.float() * kv_scale
    t = sum(query_lens)
    positions = torch.cat([torch.arange(c - n, c, device="cuda") for n, c in zip(query_lens, ctx)])
    scores = torch.rand(t, max(ctx), device="cuda", generator=gen)
    idx = dsa.topk_causal(scores, positions, TOPK)
    tok_seq = torch.repeat_interleave(torch.arange(len(ctx), device="cuda"), torch.tensor(query_lens, device="cuda"))
    qn = torch.randn(t, heads, DN, device="cuda", generator=gen).to(torch.bfloat16)
    qr = torch.randn(t, heads, DR, device="cuda", generator=gen).to(torch.bfloat16)
    kvb = (torch.randn(heads * (DN + DV), R, device="cuda", generator=gen) * 0.05).to(torch.bfloat16)
    scale = (DN + DR) ** -0.5
    ref = sparse_mla(qn, qr, deq, 1, bt[tok_seq], idx, kvb, R, DV, scale)
    got = sparse_mla_fast(qn, qr, pages, 1, bt, tok_seq.int(), idx, kvb, R, DV, scale, kv_scale)
    assert rel_err(got, ref) < 1e-2


def test_sparse_mla_with_every_position_equals_dense_decode():
    """top-k >= context: the sparse kernel over all causal positions is the dense paged decode."""
    from hyserve.ops.mla_decode import mla_absorbed_decode_fast
    from hyserve.ops.sparse_mla_triton import sparse_mla_fast

    gen = torch.Generator(device="cuda").manual_seed(7)
    ctx = [2048, 1000]
    pool, bt = paged_pool(ctx, R + DR, torch.float32, device="cuda", bs=BS)
    pages = pool.normal_(generator=gen).to(torch.bfloat16)
    idx = torch.full((2, 2048), -1, dtype=torch.long, device="cuda")
    idx[0] = torch.arange(2048, device="cuda")
    idx[1, :1000] = torch.arange(1000, device="cuda")
    qn = torch.randn(2, H, DN, device="cuda", generator=gen).to(torch.bfloat16)
    qr = torch.randn(2, H, DR, device="cuda", generator=gen).to(torch.bfloat16)
    kvb = (torch.randn(H * (DN + DV), R, device="cuda", generator=gen) * 0.05).to(torch.bfloat16)
    scale = (DN + DR) ** -0.5
    ctx_t = torch.tensor(ctx, device="cuda")
    dense = mla_absorbed_decode_fast(qn, qr, pages, 1, bt, ctx_t, max(ctx), kvb, R, DV, scale)
    sparse = sparse_mla_fast(qn, qr, pages, 1, bt, torch.arange(2, device="cuda", dtype=torch.int32), idx, kvb, R, DV, scale)
    assert rel_err(sparse, dense) < 1e-2
