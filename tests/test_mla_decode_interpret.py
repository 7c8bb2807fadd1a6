"""The paged MLA decode kernels (hyserve/ops/mla_decode.py: split-K over the context, log-sum-exp
combine) run by Triton's CPU interpreter in fp32 against the torch reference (ops/mla_attention,
spec/models.md §2.5). TRITON_INTERPRET=1 must be set before triton is imported (tests/conftest.py does
it without CUDA); tests/gpu/test_mla_moe_gpu.py checks the compiled kernels."""

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


def case(ctx: list[int], seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    blocks = [-(-c // BS) for c in ctx]
    pages = torch.randn(sum(blocks) + 1, 2, BS, R + DR, generator=gen)
    perm = torch.randperm(sum(blocks) + 1, generator=gen)
    bt = torch.zeros(len(ctx), max(blocks), dtype=torch.long)
    at = 0
    for i, b in enumerate(blocks):
        bt[i, :b] = perm[at : at + b]
        at += b
    qn, qr = torch.randn(len(ctx), H, DN, generator=gen), torch.randn(len(ctx), H, DR, generator=gen)
    kvb = torch.randn(H * (DN + DV), R, generator=gen) * 0.2
    return pages, bt, qn, qr, kvb, torch.tensor(ctx)


@pytest.mark.parametrize("max_context,num_splits", [(None, 1), (None, 3), (400, 8), (400, None)],
                         ids=["one-split", "three-splits", "planned-for-a-longer-context", "default-plan"])
def test_decode_matches_the_reference(mla, max_context, num_splits):
    """Sequences of different lengths; a plan made for a longer context than any (as a CUDA graph plans
    for max_model_len) spreads each sequence over the splits and gives the same result."""
    ctx = [37, 5, 120]
    pages, bt, qn, qr, kvb, ctx_t = case(ctx)
    ref = mla_absorbed_decode(qn, qr, pages, 1, bt, ctx_t, kvb, R, DV, 0.3)
    w = kvb.view(H, DN + DV, R)
    q_full = torch.cat([torch.einsum("nhd,hdr->nhr", qn, w[:, :DN]), qr], -1).contiguous()
    o_lat = mla.mla_decode_latent(q_full, pages[:, 1], bt, ctx_t, max_context or max(ctx), 0.3, R,
                                  num_splits=num_splits, block_n=16)
    got = torch.einsum("nhr,hvr->nhv", o_lat, w[:, DN:])
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
