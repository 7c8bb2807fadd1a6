"""The decode-sized MoE kernels (hyserve/ops/moe_gemv.py) run by Triton's CPU interpreter against the torch
reference (ops/moe.experts_forward plus the shared expert as a dense MLP, spec/models.md §2.6).
tests/gpu/test_mla_moe_gpu.py checks the compiled kernels at the 48B shape."""

from __future__ import annotations

import importlib

import pytest
import torch
from interpret_util import INTERPRETED

from hyserve.models.layers.activation import GLU
from hyserve.models.layers.moe import DenseMLP
from hyserve.ops.moe import experts_forward

pytestmark = INTERPRETED

E, D, INTER, K = 12, 48, 32, 3


@pytest.fixture(scope="module")
def gemv():
    return importlib.import_module("hyserve.ops.moe_gemv")


def _weights(seed: int, act: GLU, inter: int = INTER):
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(E, 2 * inter, D, generator=gen) * 0.2
    w2 = torch.randn(E, D, inter, generator=gen) * 0.2
    shared = DenseMLP(D, inter, act)
    for p in shared.parameters():
        p.data = torch.randn(p.shape, generator=gen) * 0.2
    return w13, w2, shared


def _routing(t: int, seed: int):
    gen = torch.Generator().manual_seed(100 + seed)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(t)])
    return ids, torch.rand(t, K, generator=gen) + 0.1


@pytest.mark.parametrize("act", [GLU("silu"), GLU("situ", 3.0, 2.0)], ids=["silu", "situ"])
@pytest.mark.parametrize("t", [1, 3])
def test_routed_experts_match_the_reference(gemv, act, t):
    w13, w2, _ = _weights(t, act)
    x = torch.randn(t, D, generator=torch.Generator().manual_seed(t))
    ids, w = _routing(t, t)
    got = gemv.experts_forward_gemv(x, ids, w, w13, w2, act, up=(16, 16, 4, 1), down=(16, 16, 4, 1))
    torch.testing.assert_close(got, experts_forward(x, ids, w, w13, w2, act), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("act", [GLU("silu"), GLU("situ", 3.0, 2.0)], ids=["silu", "situ"])
@pytest.mark.parametrize("t", [1, 4])
def test_shared_expert_rides_as_the_last_pair(gemv, act, t):
    w13, w2, shared = _weights(10 + t, act)
    assert gemv.shared_fits(shared, w13, w2)
    x = torch.randn(t, D, generator=torch.Generator().manual_seed(t))
    ids, w = _routing(t, t)
    got = gemv.experts_forward_gemv(x, ids, w, w13, w2, act, shared=shared, up=(16, 16, 4, 1), down=(16, 16, 4, 1))
    want = experts_forward(x, ids, w, w13, w2, act) + shared(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("inter", [24, 12])
@pytest.mark.parametrize("with_shared", [False, True], ids=["routed", "shared"])
def test_an_expert_width_off_the_row_block_still_matches(gemv, inter, with_shared):
    """Widths that are not a multiple of block_n (tiny checkpoints: 24): the shared expert's gate and up
    halves must not share a row block."""
    act = GLU("silu")
    w13, w2, shared = _weights(20 + inter, act, inter)
    x = torch.randn(2, D, generator=torch.Generator().manual_seed(inter))
    ids, w = _routing(2, inter)
    got = gemv.experts_forward_gemv(x, ids, w, w13, w2, act, shared=shared if with_shared else None,
                                    up=(16, 16, 4, 1), down=(16, 16, 4, 1))
    want = experts_forward(x, ids, w, w13, w2, act) + (shared(x) if with_shared else 0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_bf16_activation_is_rounded_as_the_torch_glu_rounds_it(gemv):
    """In bf16 the fused SiLU-GLU rounds to bf16 before the down projection, as GLU.__call__ does."""
    act = GLU("silu")
    w13, w2, shared = (z.to(torch.bfloat16) if isinstance(z, torch.Tensor) else z.to(torch.bfloat16)
                       for z in _weights(7, act))
    x = torch.randn(2, D, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    ids, w = _routing(2, 7)
    got = gemv.experts_forward_gemv(x, ids, w, w13, w2, act, shared=shared, up=(16, 16, 4, 1), down=(16, 16, 4, 1)).float()
    want = experts_forward(x.float(), ids, w, w13.float(), w2.float(), act) + shared.float()(x.float())
    assert (got - want).abs().max() <= 2e-2 * want.abs().max()


def test_a_shared_expert_of_another_width_does_not_fit(gemv):
    w13, w2, _ = _weights(0, GLU("silu"))
    assert not gemv.shared_fits(DenseMLP(D, 2 * INTER, GLU("silu")), w13, w2)


def test_no_tokens_give_no_rows(gemv):
    w13, w2, shared = _weights(0, GLU("silu"))
    got = gemv.experts_forward_gemv(torch.zeros(0, D), torch.zeros(0, K, dtype=torch.long), torch.zeros(0, K),
                                    w13, w2, GLU("silu"), shared=shared, up=(16, 16, 4, 1), down=(16, 16, 4, 1))
    assert got.shape == (0, D)


@pytest.mark.parametrize("t", [1, 3])
def test_unsummed_moe_output_through_the_residual_norm_equals_the_summed_path(gemv, t, monkeypatch):
    """MoE.forward(summed=False) on the decode kernels hands back the per-pair partials, and add_rms_norm
    sums them inside its kernel: the same residual stream and normed output, bit for bit, as the pair-sum
    kernel followed by the plain residual norm (the decode GPU path: an H200's kernel plan, interpreted)."""
    from hyserve.models.config import parse_config
    from hyserve.models.layers import moe as moe_layer
    from hyserve.models.layers import norm
    from hyserve.models.presets import preset_config
    from hyserve.ops.device_spec import H200
    from hyserve.ops.kernel_plan import plan_kernels

    monkeypatch.setattr(norm, "no_grad_fast_path", lambda *a: True)
    cfg = parse_config(preset_config("kimi-linear-tiny"))
    plan = plan_kernels(cfg, H200, torch.float32)
    gen = torch.Generator().manual_seed(40 + t)
    layer = moe_layer.MoE(cfg)
    for p in layer.parameters():
        p.data = torch.randn(p.shape, generator=gen) * 0.2
    x = torch.randn(t, cfg.hidden_size, generator=gen)
    residual, w = torch.randn(t, cfg.hidden_size, generator=gen), 1 + 0.1 * torch.randn(cfg.hidden_size, generator=gen)
    with torch.no_grad():
        parts = layer(x, summed=False, plan=plan)
        assert isinstance(parts, gemv.PairParts) and parts.pairs == cfg.num_experts_per_tok + 1
        got = norm.add_rms_norm(residual, parts, w, 1e-6)
        want = norm.add_rms_norm(residual, layer(x, plan=plan), w, 1e-6)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
