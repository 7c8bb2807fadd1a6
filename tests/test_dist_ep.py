"""Expert parallelism on gloo processes: dispatch and combine by uneven all-to-all equal the single-device
experts bit for bit in fp32, with ranks that send nothing and experts that receive nothing; the MoE block
of each preset equals the single-device block bit for bit; whole-model logits under TP+EP equal one
process's."""

from __future__ import annotations

import pytest
import torch
from dist_util import logits_error, rank_pool

from hyserve.distributed import ParallelConfig
from hyserve.distributed.context import StepContext
from hyserve.distributed.ep import ep_experts_forward
from hyserve.distributed.model import shard_model
from hyserve.distributed.sharding import Split
from hyserve.models.layers.activation import GLU
from hyserve.models.loader import load_model
from hyserve.ops import moe as moe_ops

E, K, D, INTER = 8, 2, 16, 8


def _ep(world: int) -> ParallelConfig:
    return ParallelConfig(tensor_parallel_size=world, enable_expert_parallel=True)


def _uneven_dispatch(state) -> tuple[bool, list[int]]:
    """Rank r holds r tokens (rank 0 none); every token picks experts 1 and 6 only, so most experts
    (and at EP4 two ranks) receive nothing."""
    gen = torch.Generator().manual_seed(1)
    w13, w2 = torch.randn(E, 2 * INTER, D, generator=gen), torch.randn(E, D, INTER, generator=gen)
    world = state.ep.size
    n = world * (world - 1) // 2
    x = torch.randn(n, D, generator=gen)
    ids = torch.tensor([[1, 6], [6, 1]] * n)[:n]
    weights = torch.rand(n, K, generator=gen)
    ref = moe_ops.experts_forward(x, ids, weights, w13, w2, GLU("silu"))
    r = state.ep.rank
    a, b = r * (r - 1) // 2, r * (r + 1) // 2
    mine = Split(0, E, world).owned(r)
    got = ep_experts_forward(x[a:b], ids[a:b], weights[a:b], w13[mine.start : mine.stop], w2[mine.start : mine.stop],
                             GLU("silu"), state.ep)
    return torch.equal(got, ref[a:b]), list(got.shape)


@pytest.mark.parametrize("world", [2, 4])
def test_uneven_dispatch_and_combine_equal_one_device_bitwise(world):
    out = rank_pool(world).run(_uneven_dispatch, layout=_ep(world))
    assert out == [(True, [r * (r + 1) // 2 - r * (r - 1) // 2, D]) for r in range(world)]


def _moe_block_bitwise(state, preset: str, tokens: int) -> bool:
    model = load_model(preset, dtype="float32")
    ctx = StepContext(state, num_tokens=tokens)
    rank_model = shard_model(model, ctx)
    i = model.config.mlp_types.index("moe")
    x = torch.randn(tokens, model.config.hidden_size, generator=torch.Generator().manual_seed(2))
    ref = model.model.layers[i].block_sparse_moe(x)
    return torch.equal(rank_model.model.layers[i].block_sparse_moe(x), ref)


@pytest.mark.parametrize("tokens", [1, 3, 13])
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("preset", ["kimi-linear-tiny", "k3-tiny"])
def test_moe_block_equals_one_device_bitwise(preset, world, tokens):
    assert all(rank_pool(world).run(_moe_block_bitwise, preset, tokens, layout=_ep(world)))


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("preset", ["kimi-linear-tiny", "k3-tiny", "k3.1-tiny"])
def test_tp_ep_logits_equal_single_process(preset, world):
    errors = rank_pool(world).run(logits_error, preset, layout=_ep(world))
    assert max(errors) < 1e-5, errors
