"""The paged MLA decode kernels (hyserve/ops/mla_decode.py: split-K over the context, log-sum-exp
combine) run by Triton's CPU interpreter in fp32 against the torch reference (ops/mla_attention,
spec/models.md §2.5). TRITON_INTERPRET=1 must be set before triton is imported (tests/conftest.py does
it without CUDA); tests/gpu/test_mla_moe_gpu.py checks the compiled kernels in bf16.

Every kernel path is covered: the layouts ("rows": rows as the M side of the products, "heads", and
"heads64": heads padded to a block of 64, the padding masked), fp32 and bf16 split partials, tiles
that are whole pages, parts of a page or span several pages (per-row lookups), the rope product as a dot
or, under 16 dims, as a sum; contexts that end inside a tile, shorter than a tile, of one row; batches
of different lengths; plans made for a longer context than any (as a CUDA graph plans for
max_model_len) and splits that see no row. The L2 prefetch and the early (PDL) combine launch are PTX,
so on the CPU the wrapper runs without them; passing them must still give the same result."""

from __future__ import annotations

import importlib
import importlib.util

import pytest
import torch
from interpret_util import INTERPRETED

from hyserve.ops.mla_attention import mla_absorbed_decode

pytestmark = INTERPRETED
H, DN, DR, DV, R, BS = 4, 16, 16, 16, 32, 8


@pytest.fixture(scope="module")
def mla():
    return importlib.import_module("hyserve.ops.mla_decode")


def case(ctx: list[int], seed: int = 0, bs: int = BS, dr: int = DR, h: int = H):
    """Pages [blocks, 2 layers, bs, R + dr] in a shuffled order, block tables padded with -1 (as the
    engine's), queries and kv_b; the layer-1 view is what the kernels read."""
    gen = torch.Generator().manual_seed(seed)
    blocks = [-(-c // bs) for c in ctx]
    pages = torch.randn(sum(blocks) + 1, 2, bs, R + dr, generator=gen)
    perm = torch.randperm(sum(blocks) + 1, generator=gen)
    bt = torch.full((len(ctx), max(blocks) + 1), -1, dtype=torch.long)
    at = 0
    for i, b in enumerate(blocks):
        bt[i, :b] = perm[at : at + b]
        at += b
    qn, qr = torch.randn(len(ctx), h, DN, generator=gen), torch.randn(len(ctx), h, dr, generator=gen)
    kvb = torch.randn(h * (DN + DV), R, generator=gen) * 0.2
    return pages, bt, qn, qr, kvb, torch.tensor(ctx)


def q_full_of(qn, qr, kvb, h: int = H):
    w = kvb.view(h, DN + DV, R)
    return torch.cat([torch.einsum("nhd,hdr->nhr", qn, w[:, :DN]), qr], -1).contiguous(), w


def reference_latent(q_full, pages, layer, bt, ctx, scale):
    """o_lat [N, H, R] straight from the rows, one sequence at a time."""
    bs = pages.shape[2]
    out = []
    for i, c in enumerate(ctx.tolist()):
        pos = torch.arange(c)
        rows = pages[bt[i, pos // bs], layer, pos % bs]  # [c, R + d_r]
        p = torch.softmax(q_full[i] @ rows.t() * scale, -1)
        out.append(p @ rows[:, :R])
    return torch.stack(out)


@pytest.mark.parametrize("max_context,num_splits", [(None, 1), (None, 3), (400, 8), (400, None)],
                         ids=["one-split", "three-splits", "planned-for-a-longer-context", "default-plan"])
def test_decode_matches_the_reference(mla, max_context, num_splits):
    """Sequences of different lengths; a plan made for a longer context than any (as a CUDA graph plans
    for max_model_len) spreads each sequence over the splits and gives the same result."""
    ctx = [37, 5, 120]
    pages, bt, qn, qr, kvb, ctx_t = case(ctx)
    ref = mla_absorbed_decode(qn, qr, pages, 1, bt, ctx_t, kvb, R, DV, 0.3)
    q_full, w = q_full_of(qn, qr, kvb)
    o_lat = mla.mla_decode_latent(q_full, pages[:, 1], bt, ctx_t, max_context or max(ctx), 0.3, R,
                                  num_splits=num_splits, block_n=16)
    got = torch.einsum("nhr,hvr->nhv", o_lat, w[:, DN:])
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


# (block_size, block_n): whole pages, two tiles per page, four per page, tiles over two and four pages
TILINGS = [(16, 16), (32, 16), (64, 16), (8, 16), (8, 32)]


@pytest.mark.parametrize("layout", ["rows", "heads", "heads64"])
@pytest.mark.parametrize("bs,block_n", TILINGS, ids=[f"bs{b}-bn{n}" for b, n in TILINGS])
@pytest.mark.parametrize("ctx,max_context,num_splits", [
    ([37, 5, 120, 64], None, None),  # ends inside a tile, shorter than a tile, whole tiles; planned
    ([1, 200, 16], 1000, None),  # a context of one row; plan for a longer context (graphs)
    ([77, 3], 600, 9),  # splits that see no row (the combine must not read their partials)
    ([150], None, 1),  # one split walks every tile
], ids=["mixed", "graph-plan", "empty-splits", "single-split"])
def test_kernel_paths(mla, layout, bs, block_n, ctx, max_context, num_splits):
    pages, bt, qn, qr, kvb, ctx_t = case(ctx, seed=len(ctx) + bs, bs=bs)
    q_full, _ = q_full_of(qn, qr, kvb)
    ref = reference_latent(q_full, pages, 1, bt, ctx_t, 0.3)
    got = mla.mla_decode_latent(q_full, pages[:, 1], bt, ctx_t, max_context or max(ctx), 0.3, R,
                                num_splits=num_splits, block_n=block_n, layout=layout)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", ["rows", "heads", "heads64"])
def test_rope_under_sixteen_dims_and_odd_head_count(mla, layout):
    """d_r = 8 takes the sum instead of tl.dot; 5 heads leave part of the 16-head block masked."""
    pages, bt, qn, qr, kvb, ctx_t = case([45, 9], seed=3, bs=16, dr=8, h=5)
    q_full, _ = q_full_of(qn, qr, kvb, h=5)
    ref = reference_latent(q_full, pages, 1, bt, ctx_t, 0.25)
    got = mla.mla_decode_latent(q_full, pages[:, 1], bt, ctx_t, 45, 0.25, R, block_n=16, layout=layout)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", ["rows", "heads"])
def test_rope_values_read_from_their_own_view_equal_the_concatenated_query(mla, layout):
    """q_rope passed apart (a strided slice of the projection, as the layer has it) and the latent part a
    transposed view (the absorbing bmm's [H, N, R] output): the same result as one concatenated row, bit
    for bit."""
    pages, bt, qn, qr, kvb, ctx_t = case([45, 9, 70], seed=4, bs=16)
    q_full, _ = q_full_of(qn, qr, kvb)
    proj = torch.cat([torch.randn(3, H, DN), qr], -1)  # [N, H, d_n + d_r]: the rope values a slice of it
    lat_hnr = q_full[..., :R].transpose(0, 1).contiguous()  # [H, N, R], the bmm's layout
    want = mla.mla_decode_latent(q_full, pages[:, 1], bt, ctx_t, 70, 0.3, R, block_n=16, layout=layout)
    got = mla.mla_decode_latent(lat_hnr.transpose(0, 1), pages[:, 1], bt, ctx_t, 70, 0.3, R, block_n=16,
                                layout=layout, q_rope=proj[..., DN:])
    assert torch.equal(got, want)


def test_gpu_only_knobs_are_ignored_on_the_cpu(mla):
    """prefetch and pdl are PTX: the wrapper drops them on the CPU and the result does not change;
    num_warps / num_stages only matter to the compiler."""
    pages, bt, qn, qr, kvb, ctx_t = case([90, 33], seed=5, bs=32)
    q_full, _ = q_full_of(qn, qr, kvb)
    ref = reference_latent(q_full, pages, 1, bt, ctx_t, 0.3)
    got = mla.mla_decode_latent(q_full, pages[:, 1], bt, ctx_t, 500, 0.3, R, block_n=32, num_warps=8,
                                num_stages=3, prefetch=4, pdl=True)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", ["heads", "heads64", "rows"])
@pytest.mark.parametrize("num_splits", [1, 3, 9])
def test_bf16_partials(mla, layout, num_splits):
    """partial_dtype=bf16 rounds each split's normalised partial once (products, softmax and the combine's
    sums stay fp32): the result is within bf16 rounding of the reference, fp32 either way, and one split
    (no combine) returns it converted."""
    ctx = [77, 3, 150]
    pages, bt, qn, qr, kvb, ctx_t = case(ctx, seed=13, bs=16)
    q_full, _ = q_full_of(qn, qr, kvb)
    ref = reference_latent(q_full, pages, 1, bt, ctx_t, 0.3)
    got = mla.mla_decode_latent(q_full, pages[:, 1], bt, ctx_t, 600, 0.3, R, num_splits=num_splits, block_n=16,
                                layout=layout, partial_dtype=torch.bfloat16)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, ref, rtol=1e-2, atol=1e-2)
    assert float((got - ref).norm() / ref.norm()) < 5e-3


def test_long_context_is_split_within_the_tile_cap(mla):
    """MAX_TILES x block_n rows is the most one split walks: a longer context gets more splits than asked
    for, and the result is unchanged."""
    ctx = [16 * mla.MAX_TILES + 40]
    pages, bt, qn, qr, kvb, ctx_t = case(ctx, seed=7, bs=16)
    q_full, _ = q_full_of(qn, qr, kvb)
    ref = reference_latent(q_full, pages, 1, bt, ctx_t, 0.2)
    got = mla.mla_decode_latent(q_full, pages[:, 1], bt, ctx_t, ctx[0], 0.2, R, num_splits=1, block_n=16)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_combine_skips_splits_without_rows(mla):
    """A split with lse = -inf left its partial unwritten (NaN here): the combine must not read it; one
    sequence with no row at all gets zeros."""
    gen = torch.Generator().manual_seed(11)
    part = torch.randn(2, 5, 3, 64, generator=gen)
    lse = torch.randn(2, 5, 3, generator=gen)
    lse[0, [1, 3]] = float("-inf")
    part[0, [1, 3]] = float("nan")
    lse[1] = float("-inf")
    part[1] = float("nan")
    got = mla.combine_splits(part, lse)
    keep = [0, 2, 4]
    wts = torch.softmax(lse[0, keep] * torch.log(torch.tensor(2.0)), 0)  # log2-sum-exp weights
    torch.testing.assert_close(got[0], torch.einsum("sh,shr->hr", wts, part[0, keep]), rtol=1e-5, atol=1e-6)
    assert torch.equal(got[1], torch.zeros_like(got[1]))


def test_split_plan(mla):
    """About one program per SM with the fewest splits that fill the machine; no split over MAX_TILES."""
    plan = mla.plan_splits
    assert plan(1, 1, 32768, 64, 132) in range(120, 133)  # batch 1: ~4 tiles a program
    assert plan(8, 1, 32768, 64, 132) == 16  # 128 programs, one wave
    assert plan(64, 1, 8192, 64, 132) == 2
    assert plan(1, 1, 1, 64, 132) == 1
    for n, ctx in ((1, 1 << 20), (256, 131072), (3, 5000)):
        s = plan(n, 1, ctx, 64, 132)
        rows = -(-ctx // s)
        assert -(-rows // 64) <= mla.MAX_TILES


def test_absorbed_decode_wrapper_matches_the_reference(mla):
    """The layer's entry point: q_n and q_r as slices of one projection output, the latent query from the
    absorbing bmm read in place with the rope values (no concatenation), back through W_UV."""
    pages, bt, qn, qr, kvb, ctx_t = case([45, 9, 70], seed=6, bs=16)
    q = torch.cat([qn, qr], -1)  # [N, H, d_n + d_r], as the layer's q projection
    ref = mla_absorbed_decode(qn, qr, pages, 1, bt, ctx_t, kvb, R, DV, 0.3)
    got = mla.mla_absorbed_decode_fast(q[..., :DN], q[..., DN:], pages, 1, bt, ctx_t, 70, kvb, R, DV, 0.3)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_latent_output_in_the_model_dtype_is_the_fp32_result_rounded_once(mla, num_splits):
    """out_dtype: the combine kernel (or the single split's partial) rounds the fp32 result itself, so the
    W_UV GEMM after it needs no cast kernel. (fp16: the interpreter truncates bf16 casts.)"""
    pages, bt, qn, qr, kvb, ctx_t = case([45, 9, 70], seed=7, bs=16)
    q_full, _ = q_full_of(qn, qr, kvb)
    args = (q_full, pages[:, 1], bt, ctx_t, 70, 0.3, R)
    want = mla.mla_decode_latent(*args, num_splits=num_splits, block_n=16).half()
    got = mla.mla_decode_latent(*args, num_splits=num_splits, block_n=16, out_dtype=torch.float16)
    assert got.dtype == torch.float16 and torch.equal(got, want)


def test_the_gluon_wgmma_layout_is_refused_with_a_reason_off_hopper(mla):
    """layout "wgmma" (mla_decode_wgmma, Gluon) has no interpreter form: off a Hopper GPU the call says so
    instead of running something else; tests/gpu checks the kernel itself."""
    pages, bt, qn, qr, kvb, ctx_t = case([90, 33], seed=6, bs=64)
    q_full, _ = q_full_of(qn, qr, kvb)
    with pytest.raises(ValueError, match="Hopper"):
        mla.mla_decode_latent(q_full, pages[:, 1], bt, ctx_t, 500, 0.3, R, layout="wgmma")
