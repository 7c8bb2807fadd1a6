"""The fused RMSNorm kernel on the GPU against the torch reference, at the 48B shape's widths."""

from __future__ import annotations

import pytest
import torch

from hyserve.models.layers.norm import rms_norm
from hyserve.ops.dispatch import reference_ops

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("rows,dim", [(1, 2304), (64, 2304), (4096, 2304), (3, 512), (5, 1536)])
def test_fused_rms_norm_matches_the_reference(rows, dim):
    from hyserve.ops.rms_norm import rms_norm_fast

    gen = torch.Generator(device="cuda").manual_seed(rows)
    x = (torch.randn(rows, dim, device="cuda", generator=gen) * 3).to(torch.bfloat16)
    w = (1 + 0.2 * torch.randn(dim, device="cuda", generator=gen)).to(torch.bfloat16)
    with reference_ops():
        ref = rms_norm(x, w, 1e-6)
    got = rms_norm_fast(x, w, 1e-6)
    torch.testing.assert_close(got, ref, rtol=1.6e-2, atol=1e-2)  # two bf16 steps
    assert (got == ref).float().mean() > 0.99


@pytest.mark.parametrize("rows", [1, 64, 4096])
def test_fused_residual_add_is_torch_add_and_its_norm(rows):
    from hyserve.models.layers.norm import add_rms_norm

    gen = torch.Generator(device="cuda").manual_seed(rows)
    x = (torch.randn(rows, 2304, device="cuda", generator=gen) * 3).to(torch.bfloat16)
    d = (torch.randn(rows, 2304, device="cuda", generator=gen) * 3).to(torch.bfloat16)
    w = (1 + 0.2 * torch.randn(2304, device="cuda", generator=gen)).to(torch.bfloat16)
    with reference_ops():
        ref_sum, ref = add_rms_norm(x, d, w, 1e-6)
    total, got = add_rms_norm(x, d, w, 1e-6)
    assert torch.equal(total, ref_sum)
    torch.testing.assert_close(got, ref, rtol=1.6e-2, atol=1e-2)
    assert (got == ref).float().mean() > 0.99


@pytest.mark.parametrize("pdl", [False, True], ids=["plain", "pdl"])
@pytest.mark.parametrize("rows", [1, 4, 7])
def test_moe_pair_partials_summed_in_the_norm_equal_the_pair_sum_kernel_then_the_norm(rows, pdl, monkeypatch):
    """A decode MoE's fp32 per-pair outputs (9 pairs at the 48B width) summed by the residual norm kernel:
    bit for bit what the pair-sum kernel followed by the residual norm gives; with PDL launched right after
    a kernel that writes the partials (the down kernel's place)."""
    from hyserve.models.layers.norm import add_rms_norm
    from hyserve.ops import rms_norm as kernel
    from hyserve.ops.moe_gemv import PairParts

    gen = torch.Generator(device="cuda").manual_seed(10 + rows)
    x = (torch.randn(rows, 2304, device="cuda", generator=gen) * 3).to(torch.bfloat16)
    w = (1 + 0.2 * torch.randn(2304, device="cuda", generator=gen)).to(torch.bfloat16)
    src = torch.randn(rows * 9, 2304, device="cuda", generator=gen)
    part = torch.empty_like(src)
    monkeypatch.setattr(kernel, "PDL", False)
    want = add_rms_norm(x, PairParts(src.clone(), 9, torch.bfloat16, False).sum(), w, 1e-6)
    monkeypatch.setattr(kernel, "PDL", pdl)
    torch.mul(src, 1.0, out=part)  # the kernel before the PDL launch writes the partials
    got = add_rms_norm(x, PairParts(part, 9, torch.bfloat16, pdl), w, 1e-6)
    torch.cuda.synchronize()
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("rows", [1, 64])
def test_norm_with_pdl_in_a_graph_equals_the_plain_launch(rows):
    """A residual norm launched as a programmatic dependent right after a kernel that writes its delta,
    and a plain norm after it as a dependent in turn: bit for bit the plain launches."""
    from hyserve.ops.rms_norm import rms_norm_fast

    gen = torch.Generator(device="cuda").manual_seed(30 + rows)
    x = (torch.randn(rows, 2304, device="cuda", generator=gen) * 3).to(torch.bfloat16)
    src = (torch.randn(rows, 2304, device="cuda", generator=gen) * 3).to(torch.bfloat16)
    w = (1 + 0.2 * torch.randn(2304, device="cuda", generator=gen)).to(torch.bfloat16)
    total, h = rms_norm_fast(x, w, 1e-6, residual_delta=src, pdl=False)
    want = (total, h, rms_norm_fast(h, w, 1e-6, pdl=False))
    d = torch.zeros_like(src)
    rms_norm_fast(rms_norm_fast(x, w, 1e-6, residual_delta=d, pdl=True)[1], w, 1e-6, pdl=True)  # compiled
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.mul(src, 1.0, out=d)  # a kernel, not a copy node
        t2, h2 = rms_norm_fast(x, w, 1e-6, residual_delta=d, pdl=True)
        g2 = rms_norm_fast(h2, w, 1e-6, pdl=True)
    d.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip((t2, h2, g2), want))


def test_the_layer_takes_the_kernel_only_without_autograd():
    x = torch.randn(4, 64, device="cuda", requires_grad=True)
    w = torch.ones(64, device="cuda", requires_grad=True)
    rms_norm(x, w, 1e-5).sum().backward()  # the reference path: gradients flow
    assert x.grad is not None and w.grad is not None
