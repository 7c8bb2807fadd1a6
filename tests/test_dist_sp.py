"""Sequence-parallel prefill (TEP) on gloo processes: between the attention output projection's
reduce-scatter and the next layer's all-gather each rank holds only its shard of the step's tokens
(AttnRes and the MoE all-to-all run on it), and the logits equal one process's."""

from __future__ import annotations

import pytest
import torch
from dist_util import logits_error, rank_pool, rel_err

from hyserve.distributed import ParallelConfig
from hyserve.distributed.context import StepContext
from hyserve.distributed.model import shard_model
from hyserve.models.batch import Batch
from hyserve.models.loader import load_model

LAYOUTS = [ParallelConfig(tensor_parallel_size=2, enable_expert_parallel=True),
           ParallelConfig(tensor_parallel_size=4, enable_expert_parallel=True),
           ParallelConfig(tensor_parallel_size=2)]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda p: f"tp{p.tensor_parallel_size}{'ep' * p.enable_expert_parallel}")
@pytest.mark.parametrize("preset", ["kimi-linear-tiny", "k3-tiny", "k3.1-tiny"])
def test_sequence_parallel_logits_equal_single_process(preset, layout):
    errors = rank_pool(layout.world_size).run(logits_error, preset, True, layout=layout)
    assert max(errors) < 1e-5, errors


def _shard_rows(state, tokens: int) -> tuple[int, int, float, float]:
    """(rows of the embedding output, rows of layer 0's attention output, their errors against this
    rank's rows of the single-process tensors)."""
    model = load_model("k3-tiny", dtype="float32")
    ctx = StepContext(state, sequence_parallel=True, num_tokens=tokens)
    rank_model = shard_model(model, ctx)
    ids = torch.randint(0, 256, (tokens,), generator=torch.Generator().manual_seed(3))
    batch = Batch.build([tokens], [tokens], [[0, 1, 2]], 4, [0], [True])
    a, b = ctx.token_range()
    emb = rank_model.model.embed_tokens(ids)
    attn = rank_model.model.layers[0].attn(emb, batch, rank_model.make_cache(3, 4, 1), rank_model.kernel_plan)
    ref_emb = model.model.embed_tokens(ids)
    ref_attn = model.model.layers[0].attn(ref_emb, batch, model.make_cache(3, 4, 1), model.kernel_plan)
    return emb.shape[0], attn.shape[0], rel_err(emb[: b - a], ref_emb[a:b]), rel_err(attn[: b - a], ref_attn[a:b])


def test_between_layers_each_rank_holds_its_token_shard():
    layout = ParallelConfig(tensor_parallel_size=4, enable_expert_parallel=True)
    out = rank_pool(4).run(_shard_rows, 10, layout=layout)  # 10 tokens: shards of 3, 3, 3, 1 (+2 padding)
    assert [o[:2] for o in out] == [(3, 3)] * 4
    assert max(max(o[2:]) for o in out) < 1e-5
