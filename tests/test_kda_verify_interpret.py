"""The KDA verify kernels (hyserve/ops/kda_verify_triton.py) run by Triton's CPU interpreter against
the verify reference (hyserve/ops/kda_verify.py plus the layer's gates and norms): outputs, the state
and conv window written to every token's slot, and no other slot touched. tests/gpu/test_kda_verify_gpu.py
checks the compiled kernels at the 48B head shape."""

from __future__ import annotations

import importlib

import pytest
import torch
from interpret_util import INTERPRETED

from hyserve.models.layers.norm import gated_rms_norm, l2_normalize
from hyserve.ops import kda as ref
from hyserve.ops.kda_verify import conv_verify, recurrent_verify

pytestmark = INTERPRETED
H, K, W, SLOTS = 2, 16, 4, 14
P = H * K
EPS = 1e-5


def make_case(n: int, t: int, seed: int) -> dict:
    """Column slices of one merged projection and layer views of two-layer pools (non-contiguous)."""
    gen = torch.Generator().manual_seed(seed)
    proj = torch.randn(n * t, 3 * P + P + H + P + 3, generator=gen)
    proj[:, 3 * P : 4 * P] *= 8
    x, f, b, gate = proj[:, : 3 * P], proj[:, 3 * P : 4 * P], proj[:, 4 * P : 4 * P + H], proj[:, 4 * P + H : -3]
    table = torch.randperm(SLOTS, generator=gen)[: n * t].view(n, t)
    # each sequence starts from one of its own columns: a plain step's 0, or an accepted count
    src = torch.randint(0, t, (n,), generator=gen)
    return dict(
        x=x, f=f, b=b, gate=gate, table=table, src=src,
        conv=torch.randn(SLOTS, 2, 3 * P, W - 1, generator=gen),
        rec=torch.randn(SLOTS, 2, H, K, K, generator=gen) * 0.3,
        cw=torch.randn(3 * P, W, generator=gen) * 0.5,
        alog=torch.log(torch.rand(H, generator=gen) * 3 + 0.5),
        dtb=torch.rand(P, generator=gen) * 2 - 1,
        onw=torch.rand(K, generator=gen) + 0.5,
    )


def reference(c: dict, t: int, lower_bound: float | None):
    """The layer step on float64 copies of the pools: (out [N*T, P], conv pool, recurrent pool)."""
    n = c["table"].shape[0]
    conv, rec = c["conv"][:, 1].double().clone(), c["rec"][:, 1].double().clone()
    cu = torch.arange(n + 1) * t
    y = conv_verify(c["x"].double(), c["cw"].double(), conv, c["table"], c["src"], cu)
    q, k, v = y.to(c["x"].dtype).double().view(n * t, 3, H, K).unbind(1)
    g = ref.kda_gate(c["f"].view(n * t, H, K), c["alog"], c["dtb"], lower_bound).double()
    beta = torch.sigmoid(c["b"].double())
    o = recurrent_verify(l2_normalize(q).double(), l2_normalize(k).double(), v, g, beta, rec, c["table"],
                         c["src"], cu, K**-0.5)
    out = gated_rms_norm(o, c["gate"].view(n * t, H, K).double(), c["onw"].double(), EPS).reshape(n * t, P)
    return out, conv, rec


def run(c: dict, t: int, lower_bound: float | None, **kw) -> torch.Tensor:
    # imported here: triton must see TRITON_INTERPRET (set by conftest) before its first import
    kernels = importlib.import_module("hyserve.ops.kda_verify_triton")
    return kernels.kda_verify_multi(c["x"], c["f"], c["b"], c["gate"], c["cw"], c["conv"][:, 1], c["rec"][:, 1],
                                    c["alog"], c["dtb"], c["onw"], c["table"], c["src"], K**-0.5, EPS,
                                    lower_bound, t, **kw)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    assert torch.isfinite(a).all()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.mark.parametrize("fused", [True, False], ids=["norm-by-last-arrival", "norm-kernel"])
@pytest.mark.parametrize("lower_bound", [None, -5.0], ids=["softplus", "bounded"])
@pytest.mark.parametrize(("n", "t"), [(1, 4), (3, 2), (2, 5)])
def test_verify_kernels_match_the_reference_in_every_slot(n, t, lower_bound, fused):
    c = make_case(n, t, seed=10 * n + t)
    out_ref, conv_ref, rec_ref = reference(c, t, lower_bound)
    before_conv, before_rec = c["conv"].clone(), c["rec"].clone()
    out = run(c, t, lower_bound, block_v=8, fused_finish=fused)
    written = c["table"].reshape(-1)
    others = [s for s in range(SLOTS) if s not in written.tolist()]
    assert rel_err(out, out_ref) < 1e-5
    assert rel_err(c["rec"][written, 1], rec_ref[written]) < 1e-5
    assert torch.equal(c["conv"][written, 1].double(), conv_ref[written])  # copies of inputs: exact
    assert torch.equal(c["conv"][others], before_conv[others]) and torch.equal(c["rec"][others], before_rec[others])
    assert torch.equal(c["conv"][:, 0], before_conv[:, 0]) and torch.equal(c["rec"][:, 0], before_rec[:, 0])


def test_a_step_starting_from_its_own_first_destination_reads_the_old_window():
    """src column 0 is also token 0's destination: every read of the source comes before that write."""
    c = make_case(2, 3, seed=5)
    c["src"] = torch.zeros(2, dtype=torch.long)
    out_ref, conv_ref, rec_ref = reference(c, 3, None)
    out = run(c, 3, None)
    written = c["table"].reshape(-1)
    assert rel_err(out, out_ref) < 1e-5
    assert torch.equal(c["conv"][written, 1].double(), conv_ref[written])
    assert rel_err(c["rec"][written, 1], rec_ref[written]) < 1e-5
