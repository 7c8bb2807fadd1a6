"""The prefill KDA output norm kernel (hyserve/ops/kda_out_norm.py) run by Triton's CPU interpreter
against `norm.gated_rms_norm` (spec/models.md §2.4); tests/gpu/test_kda_gpu.py checks it compiled."""

from __future__ import annotations

import importlib

import torch
from interpret_util import INTERPRETED

from hyserve.models.layers.norm import gated_rms_norm

pytestmark = INTERPRETED


def test_rows_of_a_partial_last_tile_match_the_reference():
    norm = importlib.import_module("hyserve.ops.kda_out_norm").gated_rms_norm_rows
    gen = torch.Generator().manual_seed(0)
    t, h, k = 7, 3, 16  # 21 rows: a tile of 8 rows leaves a partial last tile
    o = torch.randn(t, h, k, generator=gen)
    gate = torch.randn(t, h * k + 9, generator=gen)[:, : h * k]  # a column slice of a wider projection
    w = torch.rand(k, generator=gen) + 0.5
    want = gated_rms_norm(o, gate.reshape(t, h, k), w, 1e-5).reshape(t, h * k)
    torch.testing.assert_close(norm(o, gate, w, 1e-5, torch.float32, block_rows=8), want, rtol=1e-6, atol=1e-6)
