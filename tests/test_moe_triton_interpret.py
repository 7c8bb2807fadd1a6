"""The Triton grouped-GEMM experts (hyserve/ops/moe_triton.py, the path for GPUs or dtypes without
torch._grouped_mm) run by Triton's CPU interpreter against the torch reference (ops/moe.experts_forward,
spec/models.md §2.6). tests/gpu/test_mla_moe_gpu.py checks the compiled kernels at the 48B shape."""

from __future__ import annotations

import importlib

import pytest
import torch
from interpret_util import INTERPRETED

from hyserve.models.layers.activation import GLU
from hyserve.ops.moe import experts_forward

pytestmark = INTERPRETED

E, D, INTER, K = 6, 40, 24, 2


@pytest.fixture(scope="module")
def moe_triton():
    return importlib.import_module("hyserve.ops.moe_triton")


def _case(t: int, seed: int, skewed: bool = False):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, D, generator=gen)
    w13 = torch.randn(E, 2 * INTER, D, generator=gen) * 0.2
    w2 = torch.randn(E, D, INTER, generator=gen) * 0.2
    if skewed:  # most pairs on expert 4, none on some experts: runs of several tiles and empty runs
        ids = torch.stack([torch.tensor([4, int(torch.randint(0, 2, (), generator=gen))]) for _ in range(t)])
    else:
        ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(t)])
    return x, ids, torch.rand(t, K, generator=gen) + 0.1, w13, w2


@pytest.mark.parametrize("act", [GLU("silu"), GLU("situ", 3.0, 2.0)], ids=["silu", "situ"])
@pytest.mark.parametrize("t", [1, 5, 37])
def test_grouped_experts_match_the_reference(moe_triton, act, t):
    x, ids, w, w13, w2 = _case(t, t)
    got = moe_triton.experts_forward_triton(x, ids, w, w13, w2, act, block_m=16, block_n=16, block_k=16)
    torch.testing.assert_close(got, experts_forward(x, ids, w, w13, w2, act), rtol=1e-5, atol=1e-5)


def test_an_expert_with_several_tiles_and_experts_with_none(moe_triton):
    x, ids, w, w13, w2 = _case(40, 3, skewed=True)
    act = GLU("silu")
    got = moe_triton.experts_forward_triton(x, ids, w, w13, w2, act, block_m=16, block_n=16, block_k=16)
    torch.testing.assert_close(got, experts_forward(x, ids, w, w13, w2, act), rtol=1e-5, atol=1e-5)


def test_tiles_hold_one_expert_each_and_every_pair_once(moe_triton):
    ids = torch.tensor([[2, 0], [2, 1], [0, 2], [2, 1]])
    pair_of_slot, tile_expert, used = moe_triton.expert_tiles(ids, 4, bm=2)
    flat = ids.reshape(-1)
    real = pair_of_slot[pair_of_slot < flat.numel()]
    assert sorted(real.tolist()) == list(range(flat.numel()))
    assert int(used) == 2 + 2 + 4  # expert 0: 2 pairs, 1: 2 pairs, 2: 4 pairs, 3: none
    for tile in range(int(used) // 2):
        pairs = pair_of_slot[2 * tile : 2 * tile + 2]
        pairs = pairs[pairs < flat.numel()]
        assert (flat[pairs] == tile_expert[tile]).all()
