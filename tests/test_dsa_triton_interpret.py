"""The DSA Triton kernels (index scoring + top-k, sparse MLA) run by Triton's CPU interpreter against the
torch references (spec/models.md §4.6, R1 contract), on small CPU tensors.

Triton decides at import time whether its own library functions (tl.max, tl.cdiv, ...) are interpreted,
so TRITON_INTERPRET=1 must be set before triton is first imported in the process: tests/conftest.py
sets it on machines without CUDA. Where CUDA is present this module skips unless TRITON_INTERPRET=1 was
set for the whole run; tests/gpu/test_dsa_gpu.py checks the compiled kernels there.
"""

from __future__ import annotations

import importlib
import importlib.util

import pytest
import torch
from dsa_util import assert_topk_sets_match, paged_pool, reference_scores, write_keys
from interpret_util import INTERPRETED

from hyserve.ops import dsa_indexer as dsa
from hyserve.ops.sparse_mla import sparse_mla

pytestmark = INTERPRETED


@pytest.fixture(scope="module")
def kernels():
    """(dsa_index_triton, sparse_mla_triton), decorated under the interpreter."""
    return (
        importlib.import_module("hyserve.ops.dsa_index_triton"),
        importlib.import_module("hyserve.ops.sparse_mla_triton"),
    )


def index_case(fmt: str, query_lens: list[int], ctx: list[int], h: int = 6, d: int = 64, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    rec = dsa.key_record_bytes(fmt, d)
    pool, bt = paged_pool(ctx, rec, torch.uint8, seed=seed)
    keys = [torch.randn(c, d, generator=gen) for c in ctx]
    write_keys(pool, bt, 1, keys, fmt)
    t = sum(query_lens)
    q = torch.randn(t, h, d, generator=gen)
    w = torch.randn(t, h, generator=gen) * h**-0.5
    positions = torch.cat([torch.arange(c - n, c) for n, c in zip(query_lens, ctx)])
    return pool, bt, q, w, positions


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
@pytest.mark.parametrize(
    "query_lens,ctx",
    [([1, 1, 1], [40, 300, 77]), ([5, 1, 23], [40, 300, 23])],
    ids=["decode", "mixed-prefill"],
)
def test_index_topk_matches_r1(kernels, fmt, query_lens, ctx):
    idx_mod, _ = kernels
    pool, bt, q, w, positions = index_case(fmt, query_lens, ctx)
    k = 16
    got = idx_mod.index_topk_fast(q, w, pool, 1, fmt, bt, query_lens, ctx, positions, k)
    assert got.shape == (sum(query_lens), min(k, max(ctx)))
    at = 0
    for i, (n, c) in enumerate(zip(query_lens, ctx)):
        sl = slice(at, at + n)
        scores = reference_scores(q[sl], w[sl], pool, bt, 1, fmt, i, c)
        assert_topk_sets_match(got[sl], scores, positions[sl], k)
        at += n


def test_a_prefill_larger_than_the_workspace_is_taken_in_row_groups(kernels, monkeypatch):
    idx_mod, _ = kernels
    query_lens, ctx = [23, 1, 30], [40, 300, 30]
    pool, bt, q, w, positions = index_case("fp8", query_lens, ctx, seed=3)
    one = idx_mod.index_topk_fast(q, w, pool, 1, "fp8", bt, query_lens, ctx, positions, 16)
    monkeypatch.setattr(dsa, "WORKSPACE_BYTES", 16 * 300 * 7)  # groups of at most 7 rows
    groups = list(idx_mod._row_groups(query_lens, ctx, 7))
    assert [g[1] - g[0] for g in groups] == [7, 7, 7, 7, 7, 7, 7, 5] and groups[3][2] == [0, 1, 2]
    chunked = idx_mod.index_topk_fast(q, w, pool, 1, "fp8", bt, query_lens, ctx, positions, 16)
    assert torch.equal(chunked, one)


@pytest.mark.parametrize("block_n", [16, 64], ids=["tile-within-a-page", "tile-over-pages"])
def test_scores_in_sort_keys_match_r1_and_mask_the_future(kernels, block_n):
    """Small chunks, so rows see key chunks wholly after their position (no cache reads); 16-token pages."""
    idx_mod, _ = kernels
    query_lens, ctx = [3, 1], [50, 130]
    pool, bt, q, w, positions = index_case("fp8", query_lens, ctx, seed=1)
    q8, wf = dsa.quantize_queries(q, w)
    comp = idx_mod.index_sort_keys(
        q8, wf, pool, 1, "fp8", bt, query_lens, positions, max(ctx), block_m=2, block_n=block_n, chunk=block_n * 2
    )
    got = idx_mod.sort_key_scores(comp)
    assert torch.equal(idx_mod._LOW32 - (comp & idx_mod._LOW32), torch.arange(max(ctx)).expand_as(comp))
    at = 0
    for i, (n, c) in enumerate(zip(query_lens, ctx)):
        ref = reference_scores(q[at : at + n], w[at : at + n], pool, bt, 1, "fp8", i, c)
        for r in range(n):
            p = int(positions[at + r])
            torch.testing.assert_close(got[at + r, : p + 1], ref[r, : p + 1], rtol=1e-5, atol=1e-6)
            assert torch.isneginf(got[at + r, p + 1 :]).all()
        at += n


def test_equal_scores_select_the_lower_positions(kernels):
    """Tie rule (spec §1.6): with every key identical all scores tie, so the first k positions win."""
    idx_mod, _ = kernels
    ctx, d = [200], 64
    pool, bt = paged_pool(ctx, dsa.key_record_bytes("fp8", d), torch.uint8)
    write_keys(pool, bt, 1, [torch.ones(200, d)], "fp8")
    q, w = torch.rand(1, 4, d), torch.rand(1, 4)
    got = idx_mod.index_topk_fast(q, w, pool, 1, "fp8", bt, [1], ctx, torch.tensor([199]), 32)
    assert got[0].tolist() == list(range(32))


def test_rows_near_the_start_pad_with_minus_one(kernels):
    """A prefill row at position t < k selects all t+1 earlier positions, the rest is -1."""
    idx_mod, _ = kernels
    pool, bt, q, w, positions = index_case("fp8", [40], [40], seed=2)
    got = idx_mod.index_topk_fast(q, w, pool, 1, "fp8", bt, [40], [40], positions, 16)
    for r in range(5):
        assert sorted(got[r, : r + 1].tolist()) == list(range(r + 1))
        assert (got[r, r + 1 :] == -1).all()


# ---- sparse MLA --------------------------------------------------------------------------------------


def sparse_case(ctx: list[int], query_lens: list[int], h: int, r: int, dr: int, dtype, k: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    pool, bt = paged_pool(ctx, r + dr, torch.float32, seed=seed)
    pool.copy_(torch.randn(pool.shape, generator=gen))
    pool = pool.to(dtype)
    dn, dv = 32, 32
    t = sum(query_lens)
    qn, qr = torch.randn(t, h, dn, generator=gen), torch.randn(t, h, dr, generator=gen)
    kvb = torch.randn(h * (dn + dv), r, generator=gen) * r**-0.5
    positions = torch.cat([torch.arange(c - n, c) for n, c in zip(query_lens, ctx)])
    # a random causal subset per row, padded with -1, the row itself always included
    idx = torch.full((t, k), -1, dtype=torch.long)
    for row, p in enumerate(positions.tolist()):
        chosen = torch.randperm(p + 1, generator=gen)[: k - 1]
        chosen = torch.unique(torch.cat([chosen, torch.tensor([p])]))
        idx[row, : chosen.numel()] = chosen[torch.randperm(chosen.numel(), generator=gen)]
    tok_seq = torch.repeat_interleave(torch.arange(len(ctx)), torch.tensor(query_lens))
    return pool, bt, qn, qr, kvb, idx, tok_seq, dv


@pytest.mark.parametrize("r,dr", [(64, 16), (512, 64)])
def test_sparse_mla_matches_reference(kernels, r, dr):
    _, sp = kernels
    ctx, query_lens, h = [30, 200, 9], [1, 4, 9], 5
    pool, bt, qn, qr, kvb, idx, tok_seq, dv = sparse_case(ctx, query_lens, h, r, dr, torch.float32, k=40)
    scale = (32 + dr) ** -0.5
    ref = sparse_mla(qn, qr, pool, 1, bt[tok_seq], idx, kvb, r, dv, scale)
    got = sp.sparse_mla_fast(qn, qr, pool, 1, bt, tok_seq, idx, kvb, r, dv, scale)
    torch.testing.assert_close(got.float(), ref, rtol=1e-4, atol=1e-5)


def test_sparse_mla_splits_combine_to_one_pass(kernels):
    """Splitting an index list over programs (log-sum-exp merge) changes nothing beyond rounding."""
    _, sp = kernels
    pool, bt, qn, qr, kvb, idx, tok_seq, dv = sparse_case([300], [2], 4, 64, 16, torch.float32, k=128)
    q_full = torch.cat([torch.randn(2, 4, 64), qr], -1)
    one = sp.sparse_mla_latent(q_full, pool[:, 1], bt, tok_seq, idx, 0.1, 64, num_splits=1)
    many = sp.sparse_mla_latent(q_full, pool[:, 1], bt, tok_seq, idx, 0.1, 64, num_splits=4)
    torch.testing.assert_close(many, one, rtol=1e-5, atol=1e-6)


def test_sparse_mla_over_fp8_pages_applies_the_layer_scale(kernels):
    """FP8 latent (spec §6.1): e4m3 rows and one fp32 layer scale act as the dequantised rows."""
    _, sp = kernels
    pool, bt, qn, qr, kvb, idx, tok_seq, dv = sparse_case([100, 60], [1, 3], 4, 64, 16, torch.float32, k=24)
    kv_scale = 0.037
    pool8 = (pool / kv_scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    deq = pool8.float() * kv_scale
    ref = sparse_mla(qn, qr, deq, 1, bt[tok_seq], idx, kvb, 64, dv, 0.2)
    got = sp.sparse_mla_fast(qn, qr, pool8, 1, bt, tok_seq, idx, kvb, 64, dv, 0.2, kv_scale=kv_scale)
    torch.testing.assert_close(got.float(), ref, rtol=1e-4, atol=1e-5)
