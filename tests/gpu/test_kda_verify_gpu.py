"""The compiled KDA verify kernels (hyserve/ops/kda_verify_triton.py) against the verify reference on the
48B head shape: bf16 inputs and conv pool, fp32 states, 1+k tokens per sequence, each sequence starting
from one of its own columns."""

from __future__ import annotations

import pytest
import torch

from hyserve.models.layers.norm import gated_rms_norm, l2_normalize
from hyserve.ops import kda as ref
from hyserve.ops.kda_verify import conv_verify, recurrent_verify

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
H, K, W = 32, 128, 4
P = H * K
EPS = 1e-5


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    assert torch.isfinite(a).all(), "non-finite values in the fast result"
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.mark.parametrize("lower_bound", [None, -5.0])
@pytest.mark.parametrize(("n", "t"), [(1, 8), (7, 4), (64, 5)])
def test_verify_kernels_match_reference(n, t, lower_bound):
    from hyserve.ops.kda_verify_triton import kda_verify_multi

    gen = torch.Generator("cuda").manual_seed(n * 16 + t)
    dev, bf = "cuda", torch.bfloat16
    slots = n * t + 3
    x = torch.randn(n * t, 3 * P, device=dev, generator=gen).to(bf)
    f = torch.randn(n * t, P, device=dev, generator=gen).to(bf)
    b = torch.randn(n * t, H, device=dev, generator=gen).to(bf)
    gate = torch.randn(n * t, P, device=dev, generator=gen).to(bf)
    cw = torch.randn(3 * P, W, device=dev, generator=gen) * 0.3
    alog = torch.log(torch.rand(H, device=dev, generator=gen) * 15 + 1)
    dtb = torch.rand(P, device=dev, generator=gen) * 2 - 1
    onw = torch.rand(K, device=dev, generator=gen) + 0.5
    conv = torch.randn(slots, 2, 3 * P, W - 1, device=dev, generator=gen).to(bf)
    rec = torch.randn(slots, 2, H, K, K, device=dev, generator=gen) * 0.1
    table = torch.randperm(slots, device=dev, generator=gen)[: n * t].view(n, t)
    src = torch.randint(0, t, (n,), device=dev, generator=gen)

    conv_ref, rec_ref = conv[:, 1].double().clone(), rec[:, 1].double().clone()
    cu = torch.arange(n + 1, device=dev) * t
    y = conv_verify(x.double(), cw.double(), conv_ref, table, src, cu)
    q, k, v = y.to(bf).double().view(n * t, 3, H, K).unbind(1)
    g = ref.kda_gate(f.view(n * t, H, K), alog, dtb, lower_bound).double()
    o = recurrent_verify(l2_normalize(q).double(), l2_normalize(k).double(), v, g, torch.sigmoid(b.double()),
                         rec_ref, table, src, cu, K**-0.5)
    o_ref = gated_rms_norm(o, gate.view(n * t, H, K).double(), onw.double(), EPS).reshape(n * t, P)

    untouched = conv[:, 0].clone(), rec[:, 0].clone()
    out = kda_verify_multi(x, f, b, gate, cw, conv[:, 1], rec[:, 1], alog, dtb, onw, table, src, K**-0.5, EPS,
                           lower_bound, t)
    torch.cuda.synchronize()
    written = table.reshape(-1)
    assert rel_err(out, o_ref) < 1e-2
    assert rel_err(rec[written, 1], rec_ref[written]) < 1e-2  # q/k/v rounded to bf16: ulp flips move ~1e-3
    assert torch.equal(conv[written, 1].double(), conv_ref[written].to(bf).double())
    assert torch.equal(conv[:, 0], untouched[0]) and torch.equal(rec[:, 0], untouched[1])
