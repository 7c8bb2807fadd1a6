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
