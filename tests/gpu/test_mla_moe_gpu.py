"""MLA decode / prefill and grouped-MoE GPU paths against the torch references (48B shapes)."""

from __future__ import annotations

import pytest
import torch

from hyserve.models.layers.activation import GLU
from hyserve.ops import mla_attention as ref
from hyserve.ops import moe as moe_ref

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
H, DN, DR, DV, R, BS = 32, 128, 64, 128, 512, 64


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    assert torch.isfinite(a).all(), "non-finite values in the fast result"
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _pages(ctx: list[int], gen, layers: int = 2):
    blocks = [(c + BS - 1) // BS for c in ctx]
    nb = sum(blocks) + 3
    pages = torch.randn(nb, layers, BS, R + DR, device="cuda", generator=gen).to(torch.bfloat16)
    perm = torch.randperm(nb, device="cuda", generator=gen)
    bt = torch.full((len(ctx), max(blocks)), -1, dtype=torch.long, device="cuda")
    s = 0
    for i, nblk in enumerate(blocks):
        bt[i, :nblk] = perm[s : s + nblk]
        s += nblk
    return pages, bt


@pytest.mark.parametrize("ctx", [[1], [77, 1000, 5], [32768, 4000]])
def test_mla_decode_matches_reference(ctx):
    from hyserve.ops.mla_decode import mla_absorbed_decode_fast

    gen = torch.Generator("cuda").manual_seed(len(ctx))
    pages, bt = _pages(ctx, gen)
    n = len(ctx)
    kvb = (torch.randn(H * (DN + DV), R, device="cuda", generator=gen) * 0.05).to(torch.bfloat16)
    qn = torch.randn(n, H, DN, device="cuda", generator=gen).to(torch.bfloat16)
    qr = torch.randn(n, H, DR, device="cuda", generator=gen).to(torch.bfloat16)
    ctx_t = torch.tensor(ctx, device="cuda")
    scale = (DN + DR) ** -0.5
    o_ref = ref.mla_absorbed_decode(qn, qr, pages, 1, bt, ctx_t, kvb, R, DV, scale)
    o = mla_absorbed_decode_fast(qn, qr, pages, 1, bt, ctx_t, max(ctx), kvb, R, DV, scale)
    assert rel_err(o, o_ref) < 1e-2


def test_mla_prefill_matches_reference():
    from hyserve.ops.mla_decode import mla_prefill_fast

    gen = torch.Generator("cuda").manual_seed(3)
    ql, cl = [300, 64, 2], [300, 1000, 70]
    pages, bt = _pages(cl, gen)
    kvb = (torch.randn(H * (DN + DV), R, device="cuda", generator=gen) * 0.05).to(torch.bfloat16)
    qn = torch.randn(sum(ql), H, DN, device="cuda", generator=gen).to(torch.bfloat16)
    qr = torch.randn(sum(ql), H, DR, device="cuda", generator=gen).to(torch.bfloat16)
    scale = (DN + DR) ** -0.5
    o = mla_prefill_fast(qn, qr, pages, 1, bt, ql, cl, kvb, R, DV, scale)
    q0 = 0
    for i, (nq, nc) in enumerate(zip(ql, cl)):
        rows = ref.gather_rows(pages, 1, bt[i], nc)
        r = ref.mla_expanded(qn[q0 : q0 + nq], qr[q0 : q0 + nq], rows, kvb, R, DV, scale, nc - nq)
        assert rel_err(o[q0 : q0 + nq], r) < 1e-2, i
        q0 += nq


@pytest.mark.parametrize("t", [1, 8, 64, 1000])
def test_grouped_moe_matches_reference(t):
    from hyserve.ops.moe_gemv import experts_forward_gemv
    from hyserve.ops.moe_grouped import experts_forward_grouped

    gen = torch.Generator("cuda").manual_seed(t)
    e, d, inter, k = 256, 2304, 1024, 8
    x = torch.randn(t, d, device="cuda", generator=gen).to(torch.bfloat16)
    w13 = (torch.randn(e, 2 * inter, d, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
    w2 = (torch.randn(e, d, inter, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
    gw = torch.randn(e, d, device="cuda", generator=gen) * 0.02
    ids, w = moe_ref.route(x, gw, None, k, renormalize=True, scaling=2.446)
    act = GLU("silu")
    y_ref = moe_ref.experts_forward(x.float(), ids, w, w13.float(), w2.float(), act)
    assert rel_err(experts_forward_grouped(x, ids, w, w13, w2, act), y_ref) < 1e-2
    if t <= 8:
        assert rel_err(experts_forward_gemv(x, ids, w, w13, w2, act), y_ref) < 1e-2
