"""The fused router selection (hyserve/ops/router_topk.py) run by Triton's CPU interpreter against the
torch reference (ops/moe.route, spec/models.md §2.6, §1.6: ties to the lower expert id).
TRITON_INTERPRET=1 must be set before triton is imported (tests/conftest.py does it without CUDA);
tests/gpu/test_mla_moe_gpu.py checks the compiled kernel."""

from __future__ import annotations

import importlib
import importlib.util

import pytest
import torch
from interpret_util import INTERPRETED

from hyserve.ops.moe import route

pytestmark = INTERPRETED


@pytest.fixture(scope="module")
def fast():
    return importlib.import_module("hyserve.ops.router_topk").route_topk_fast


def reference(x, w, bias, k, renormalize, scaling):
    return route(x, w, bias, k, renormalize=renormalize, scaling=scaling)


def test_selection_and_weights_match_the_reference(fast):
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(5, 32, generator=gen), torch.randn(64, 32, generator=gen) * 0.3
    bias = torch.randn(64, generator=gen) * 0.1
    ids, wts = fast(x @ w.t(), bias, 8, True, 2.446)
    ref_ids, ref_w = reference(x, w, bias, 8, True, 2.446)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(wts, ref_w, rtol=1e-6, atol=1e-7)


def test_equal_scores_go_to_the_lower_expert_id(fast):
    """Many exact ties (logits on a coarse grid, no bias): the stable sort's order, id by id."""
    gen = torch.Generator().manual_seed(1)
    logits = torch.randint(-2, 3, (6, 40), generator=gen).float() / 2
    eye = torch.eye(40)  # x @ eye.T = the logits themselves
    ids, wts = fast(logits, None, 6, True, 1.0)
    ref_ids, ref_w = reference(logits, eye, None, 6, True, 1.0)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(wts, ref_w, rtol=1e-6, atol=1e-7)


def test_negative_and_zero_keys_keep_the_float_order(fast):
    """A bias below -1 makes some keys negative and some exactly zero (logit 0, bias -0.5): the selection
    still ranks them as floats, ties to the lower id."""
    logits = torch.tensor([[0.0, 3.0, -1.0, 0.0, -4.0, 2.0, 0.0, -0.5]])
    bias = torch.tensor([-0.5, -2.0, 0.1, -0.5, 0.3, -1.5, -0.5, -0.7])
    eye = torch.eye(8)
    ids, wts = fast(logits, bias, 7, True, 1.0)  # two negative keys among the seven
    ref_ids, ref_w = reference(logits, eye, bias, 7, True, 1.0)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(wts, ref_w, rtol=1e-6, atol=1e-7)


def test_one_expert_without_renormalising_over_an_odd_count(fast):
    gen = torch.Generator().manual_seed(2)
    x, w = torch.randn(3, 8, generator=gen), torch.randn(6, 8, generator=gen)
    ids, wts = fast(x @ w.t(), None, 1, False, 1.5)
    ref_ids, ref_w = reference(x, w, None, 1, False, 1.5)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(wts, ref_w, rtol=1e-6, atol=1e-7)


def test_a_top_k_beyond_the_expert_count_is_refused(fast):
    with pytest.raises(ValueError, match="top_k"):
        fast(torch.zeros(1, 4), None, 5, True, 1.0)


@pytest.fixture(scope="module")
def fused():
    return importlib.import_module("hyserve.ops.router_topk").router_fused


@pytest.mark.parametrize("t,e,d,k", [(1, 64, 96, 8), (3, 40, 33, 6), (2, 6, 8, 1)])
def test_fused_router_matches_logits_then_selection(fused, t, e, d, k):
    """Several expert blocks (the last one partial) and a width that is not a multiple of the column block."""
    gen = torch.Generator().manual_seed(3 + t)
    x, w = torch.randn(t, d, generator=gen), torch.randn(e, d, generator=gen) * 0.3
    bias = torch.randn(e, generator=gen) * 0.1
    ids, wts = fused(x, w, bias, k, k > 1, 2.446, block_e=4, block_d=32)
    ref_ids, ref_w = reference(x, w, bias, k, k > 1, 2.446)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(wts, ref_w, rtol=1e-5, atol=1e-6)


def test_fused_router_leaves_its_counter_ready_for_the_next_call(fused):
    from hyserve.ops.arrival import arrival_counters

    gen = torch.Generator().manual_seed(9)
    x, w = torch.randn(2, 16, generator=gen), torch.randn(32, 16, generator=gen)
    first = fused(x, w, None, 4, True, 1.0, block_e=8, block_d=16)
    assert int(arrival_counters(x.device, 1)[0]) == 0
    second = fused(x, w, None, 4, True, 1.0, block_e=8, block_d=16)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
