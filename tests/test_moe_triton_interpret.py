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
SMALL = (16, 16, 4, 1)  # (BLOCK_N, BLOCK_K, warps, stages): 40 and 24 are not multiples, so the masked loads run


@pytest.fixture(scope="module")
def moe_triton():
    return importlib.import_module("hyserve.ops.moe_triton")


def _case(t: int, seed: int, skewed: bool = False, d: int = D, inter: int = INTER):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, d, generator=gen)
    w13 = torch.randn(E, 2 * inter, d, generator=gen) * 0.2
    w2 = torch.randn(E, d, inter, generator=gen) * 0.2
    if skewed:  # most pairs on expert 4, none on some experts: runs of several tiles and empty runs
        ids = torch.stack([torch.tensor([4, int(torch.randint(0, 2, (), generator=gen))]) for _ in range(t)])
    else:
        ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(t)])
    return x, ids, torch.rand(t, K, generator=gen) + 0.1, w13, w2


@pytest.mark.parametrize("act", [GLU("silu"), GLU("situ", 3.0, 2.0)], ids=["silu", "situ"])
@pytest.mark.parametrize("t", [1, 5, 37])
def test_grouped_experts_match_the_reference(moe_triton, act, t):
    x, ids, w, w13, w2 = _case(t, t)
    got = moe_triton.experts_forward_triton(x, ids, w, w13, w2, act, block_m=16, up=SMALL, down=SMALL)
    torch.testing.assert_close(got, experts_forward(x, ids, w, w13, w2, act), rtol=1e-5, atol=1e-5)


def test_an_expert_with_several_tiles_and_experts_with_none(moe_triton):
    x, ids, w, w13, w2 = _case(40, 3, skewed=True)
    act = GLU("silu")
    got = moe_triton.experts_forward_triton(x, ids, w, w13, w2, act, block_m=16, up=SMALL, down=SMALL)
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


def test_whole_weight_tiles_take_the_unmasked_loads_and_match(moe_triton):
    x, ids, w, w13, w2 = _case(9, 4, d=64, inter=32)
    act = GLU("silu")
    got = moe_triton.experts_forward_triton(x, ids, w, w13, w2, act, block_m=16, up=(32, 16, 4, 1), down=(16, 32, 4, 1))
    torch.testing.assert_close(got, experts_forward(x, ids, w, w13, w2, act), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("block", [128, 16], ids=["one-pass", "pairs-read-in-blocks"])
@pytest.mark.parametrize("skewed", [False, True], ids=["spread", "skewed"])
@pytest.mark.parametrize("bm", [2, 16])
def test_the_one_launch_layout_gives_each_expert_its_pairs_in_whole_tiles(moe_triton, skewed, bm, block):
    _, ids, *_ = _case(37, 5, skewed=skewed)
    flat = ids.reshape(-1)
    n = flat.numel()
    pair_of_slot, tile_expert, used = moe_triton.expert_tiles_triton(ids, E, bm, block=block)
    counts = torch.bincount(flat, minlength=E)
    assert int(used) == int(((counts + bm - 1) // bm * bm).sum())
    assert int(used) <= pair_of_slot.numel()
    slots = pair_of_slot[: int(used)].long()
    assert sorted(slots[slots < n].tolist()) == list(range(n))  # every pair once
    assert (slots[slots >= n] == n).all()  # the rest is padding
    for tile in range(int(used) // bm):
        pairs = slots[tile * bm : (tile + 1) * bm]
        pairs = pairs[pairs < n]
        assert len(pairs) > 0 and (flat[pairs] == tile_expert[tile]).all()


@pytest.mark.parametrize("shape", [(D, INTER), (64, 32)], ids=["masked", "whole-tiles"])
def test_the_glu_fused_into_the_up_gemm_matches_the_reference(moe_triton, shape):
    d, inter = shape
    x, ids, w, w13, w2 = _case(21, 6, d=d, inter=inter)
    act = GLU("silu")
    got = moe_triton.experts_forward_triton(x, ids, w, w13, w2, act, block_m=16, up=(16, 16, 4, 1), down=SMALL,
                                            fuse_glu=True)
    torch.testing.assert_close(got, experts_forward(x, ids, w, w13, w2, act), rtol=1e-5, atol=1e-5)


def test_a_large_batch_takes_the_fused_large_tile_defaults_and_matches(moe_triton):
    x, ids, w, w13, w2 = _case(100, 7)  # 200 pairs over 6 experts: past 32 per expert
    act = GLU("silu")
    torch.testing.assert_close(moe_triton.experts_forward_triton(x, ids, w, w13, w2, act),
                               experts_forward(x, ids, w, w13, w2, act), rtol=1e-5, atol=1e-5)


def test_a_non_silu_glu_is_never_fused(moe_triton):
    x, ids, w, w13, w2 = _case(100, 8)
    act = GLU("situ", 3.0, 2.0)
    torch.testing.assert_close(moe_triton.experts_forward_triton(x, ids, w, w13, w2, act, fuse_glu=True),
                               experts_forward(x, ids, w, w13, w2, act), rtol=1e-5, atol=1e-5)


def test_the_large_batch_tile_shapes_match_the_reference(moe_triton):
    """The bf16 large-batch configuration (128-pair tiles, GLU fused), run in fp32: the interpreter does not
    emulate bf16 loads (every configuration reads garbage there), so bf16 is left to tests/gpu."""
    x, ids, w, w13, w2 = _case(100, 9, d=64, inter=64)
    act = GLU("silu")
    got = moe_triton.experts_forward_triton(x, ids, w, w13, w2, act, block_m=128, up=(128, 64, 8, 4),
                                            down=(256, 64, 8, 3), fuse_glu=True)
    torch.testing.assert_close(got, experts_forward(x, ids, w, w13, w2, act), rtol=1e-5, atol=1e-5)


def test_the_layout_read_in_blocks_keeps_each_experts_pairs_in_pair_order(moe_triton):
    _, ids, *_ = _case(37, 5)
    whole = moe_triton.expert_tiles_triton(ids, E, 16, block=128)
    blocks = moe_triton.expert_tiles_triton(ids, E, 16, block=16)
    used = int(whole[2])
    assert int(blocks[2]) == used
    assert torch.equal(blocks[0][:used], whole[0][:used]) and torch.equal(blocks[1][: used // 16], whole[1][: used // 16])
