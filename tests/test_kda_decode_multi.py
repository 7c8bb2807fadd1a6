"""The fused KDA decode kernels (hyserve/ops/kda_decode.py) run by Triton's CPU interpreter against the torch
references (spec/models.md §2.4, §3.3): T new tokens per sequence equal T sequential single-token reference
steps, in outputs, state slots and conv tails, on small fp32 CPU tensors.

TRITON_INTERPRET=1 must be set before triton is first imported (tests/conftest.py does it on machines
without CUDA); where CUDA is present this module skips and tests/gpu/test_kda_gpu.py checks the compiled
kernels at the 48B head shape.
"""

from __future__ import annotations

import importlib
import importlib.util

import pytest
import torch
from interpret_util import INTERPRETED

from hyserve.models.layers.norm import gated_rms_norm, l2_normalize
from hyserve.ops import arrival
from hyserve.ops import kda as ref

pytestmark = INTERPRETED
H, K, W, SLOTS = 2, 16, 4, 7
P = H * K
EPS = 1e-5


@pytest.fixture(scope="module")
def dec():
    return importlib.import_module("hyserve.ops.kda_decode")


def make_case(n: int, t: int, fresh: list[bool], seed: int) -> dict:
    """Inputs as the layer passes them (column slices of one merged projection) and layer views of
    two-layer pools, so every stride the kernels take differs from the contiguous one."""
    gen = torch.Generator().manual_seed(seed)
    proj = torch.randn(n * t, 3 * P + P + H + P + 3, generator=gen)
    proj[:, 3 * P : 4 * P] *= 8  # softplus inputs on both sides of its threshold of 20
    x, f, b, gate = proj[:, : 3 * P], proj[:, 3 * P : 4 * P], proj[:, 4 * P : 4 * P + H], proj[:, 4 * P + H : -3]
    conv = torch.randn(SLOTS, 2, 3 * P, W - 1, generator=gen)
    rec = torch.randn(SLOTS, 2, H, K, K, generator=gen) * 0.3
    slots = torch.tensor([5, 1, 3][:n])  # unordered, with gaps
    fresh_t = torch.tensor(fresh)
    conv[slots[fresh_t], 1] = float("nan")  # a fresh slot's old contents must never be read
    rec[slots[fresh_t], 1] = float("nan")
    return dict(
        x=x, f=f, b=b, gate=gate, conv=conv, rec=rec, slots=slots, fresh=fresh_t,
        cw=torch.randn(3 * P, W, generator=gen) * 0.5,
        alog=torch.log(torch.rand(H, generator=gen) * 3 + 0.5),
        dtb=torch.rand(P, generator=gen) * 2 - 1,
        onw=torch.rand(K, generator=gen) + 0.5,
    )


def reference(c: dict, t: int, lower_bound: float | None):
    """T single-token reference steps, float64 except inside the fp32 helpers (gate, L2 norm, output norm).
    Returns (out [N*T, P], states [N, H, V, K], tails [N, 3P, W-1])."""
    n = c["slots"].shape[0]
    fr = c["fresh"]
    tails = c["conv"][c["slots"], 1].masked_fill(fr[:, None, None], 0).double()
    st = c["rec"][c["slots"], 1].masked_fill(fr[:, None, None, None], 0).double()
    rows = [torch.arange(n) * t + j for j in range(t)]
    outs = torch.empty(n * t, P)
    for r in rows:
        y, tails = ref.short_conv_step(c["x"][r].double(), c["cw"].double(), tails)
        q, k, v = y.to(c["x"].dtype).double().view(n, 3, H, K).unbind(1)  # the conv leaves in model dtype
        g = ref.kda_gate(c["f"][r].view(n, H, K), c["alog"], c["dtb"], lower_bound).double()
        beta = torch.sigmoid(c["b"][r].double())
        o, st = ref.kda_recurrent(l2_normalize(q).double(), l2_normalize(k).double(), v, g, beta, st, K**-0.5)
        outs[r] = gated_rms_norm(o, c["gate"][r].view(n, H, K).double(), c["onw"].double(), EPS).reshape(n, P)
    return outs, st, tails


def run_multi(dec, c: dict, t: int, lower_bound: float | None, **kw) -> torch.Tensor:
    kw = {"block_v": 8} | kw
    return dec.kda_decode_multi(c["x"], c["f"], c["b"], c["gate"], c["cw"], c["conv"][:, 1], c["rec"][:, 1],
                                c["alog"], c["dtb"], c["onw"], c["slots"], c["fresh"], K**-0.5, EPS, lower_bound,
                                t, **kw)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    assert torch.isfinite(a).all(), "non-finite values in the kernel's result"
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.mark.parametrize("lower_bound", [None, -5.0], ids=["softplus", "bounded"])
@pytest.mark.parametrize("fresh", [[False], [True], [True, False, False]], ids=["b1", "b1-fresh", "b3-mixed"])
@pytest.mark.parametrize("t", [1, 2, 5, 16])
def test_multi_token_decode_matches_sequential_reference(dec, t, fresh, lower_bound):
    c = make_case(len(fresh), t, fresh, seed=100 * t + len(fresh) + fresh[0])
    out_ref, st_ref, tails_ref = reference(c, t, lower_bound)
    others = [s for s in range(SLOTS) if s not in c["slots"].tolist()]
    before = c["conv"].clone(), c["rec"].clone()
    out = run_multi(dec, c, t, lower_bound)
    assert out.shape == (len(fresh) * t, P) and out.dtype == c["x"].dtype
    assert rel_err(out, out_ref) < 1e-5
    assert rel_err(c["rec"][c["slots"], 1], st_ref) < 1e-5
    assert torch.equal(c["conv"][c["slots"], 1], tails_ref.float())  # copies of inputs: exact
    assert torch.equal(c["conv"][:, 0], before[0][:, 0]) and torch.equal(c["rec"][:, 0], before[1][:, 0])
    assert torch.equal(c["conv"][others], before[0][others]) and torch.equal(c["rec"][others], before[1][others])


@pytest.mark.parametrize("lower_bound", [None, -5.0], ids=["softplus", "bounded"])
def test_bf16_inputs_and_conv_pool(dec, lower_bound):
    """Model-dtype inputs and tails: the conv output is rounded to bf16 before the norms (as the reference
    does), so an ulp flip at that rounding moves results by ~1e-3 at these small sizes; tails stay exact."""
    t = 5
    c = make_case(3, t, [False, True, False], seed=11)
    for name in ("x", "f", "b", "gate", "conv"):
        c[name] = c[name].to(torch.bfloat16)
    out_ref, st_ref, tails_ref = reference(c, t, lower_bound)
    out = run_multi(dec, c, t, lower_bound)
    assert out.dtype == torch.bfloat16
    assert rel_err(out, out_ref) < 2e-2
    assert rel_err(c["rec"][c["slots"], 1], st_ref) < 2e-2
    assert torch.equal(c["conv"][c["slots"], 1], tails_ref.to(torch.bfloat16))


@pytest.mark.parametrize("lower_bound", [None, -5.0], ids=["softplus", "bounded"])
def test_multi_token_launch_equals_single_token_launches(dec, lower_bound):
    """One launch over T tokens does the same arithmetic as T launches of the single-token entry point."""
    t, fresh = 3, [False, True, False]
    c = make_case(3, t, fresh, seed=7)
    one = {k: v.clone() for k, v in c.items()}
    out = run_multi(dec, c, t, lower_bound)
    for j in range(t):
        r = torch.arange(3) * t + j
        fr = one["fresh"] & (j == 0)  # fresh only for the first token: later steps build on the state
        o = dec.kda_decode(one["x"][r], one["f"][r], one["b"][r], one["gate"][r], one["cw"], one["conv"][:, 1],
                           one["rec"][:, 1], one["alog"], one["dtb"], one["onw"], one["slots"], fr, K**-0.5, EPS,
                           lower_bound, block_v=8)
        assert torch.equal(out[r], o), j
    assert torch.equal(c["rec"], one["rec"]) and torch.equal(c["conv"], one["conv"])


def _decode(dec, c: dict, t: int, lower_bound: float | None, block_v: int, fused_finish: bool) -> torch.Tensor:
    return dec.kda_decode_multi(c["x"], c["f"], c["b"], c["gate"], c["cw"], c["conv"][:, 1], c["rec"][:, 1],
                                c["alog"], c["dtb"], c["onw"], c["slots"], c["fresh"], K**-0.5, EPS, lower_bound,
                                t, block_v=block_v, fused_finish=fused_finish)


@pytest.mark.parametrize("lower_bound", [None, -5.0], ids=["softplus", "bounded"])
@pytest.mark.parametrize(("t", "block_v"), [(1, 4), (3, 4), (2, 16)], ids=["t1-4blocks", "t3-4blocks", "t2-1block"])
def test_fused_finish_equals_the_finish_launch_and_leaves_its_counters_zero(dec, t, block_v, lower_bound):
    """The norm applied by each head's last-arriving state program equals the separate finish launch, for
    every token of the head (K // block_v programs per head). Two calls in a row: the second runs on the
    counters the first left behind (a stale count would skip or misplace the norm) and on the states it
    wrote, as the next decode step or graph replay does."""
    c = make_case(3, t, [False, True, False], seed=31 + t)
    three = {k: v.clone() for k, v in c.items()}
    for step in range(2):
        out = _decode(dec, c, t, lower_bound, block_v, fused_finish=True)
        want = _decode(dec, three, t, lower_bound, block_v, fused_finish=False)
        assert torch.isfinite(want).all()
        assert torch.equal(out, want), step  # both run `_gated_norm_rows` on the same raw rows
        assert torch.equal(c["rec"], three["rec"]) and torch.equal(c["conv"], three["conv"])
        counters = arrival._BUFFERS[torch.device("cpu")]
        assert all(int(buf.count_nonzero()) == 0 for buf in counters)
        for case in (c, three):
            case["fresh"] = torch.zeros_like(case["fresh"])  # the slots hold a state now
            case["x"] = case["x"].roll(1, 0)  # other tokens: the second output must not repeat the first


def test_pdl_is_ignored_off_cuda(dec):
    """pdl=True on CPU tensors runs the same kernels without the griddepcontrol instructions."""
    c = make_case(3, 2, [False, True, False], seed=60)
    plain = {k: v.clone() for k, v in c.items()}
    out = run_multi(dec, c, 2, None, pdl=True)
    assert torch.equal(out, run_multi(dec, plain, 2, None))
    assert torch.equal(c["rec"], plain["rec"]) and torch.equal(c["conv"], plain["conv"])


def test_rejects_rows_not_a_multiple_of_tokens_per_seq(dec):
    c = make_case(1, 5, [False], seed=1)
    with pytest.raises(AssertionError):
        run_multi(dec, c, 3, None)
