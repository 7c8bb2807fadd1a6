"""MLA's one-kernel cache write (hyserve/ops/mla_cache.py) run by Triton's CPU interpreter against the
layer's torch form: [RMSNorm(c_kv) | k_rope] stored at each token's slot (spec/models.md §2.5).
tests/gpu/test_mla_moe_gpu.py checks the compiled kernel in bf16."""

from __future__ import annotations

import importlib

import torch
from interpret_util import INTERPRETED

from hyserve.models.layers.norm import rms_norm

pytestmark = INTERPRETED
R, DR, BS, LAYERS = 32, 16, 8, 3


def test_rows_land_normed_in_their_slots_and_nothing_else_changes():
    write = importlib.import_module("hyserve.ops.mla_cache").write_cache_rows
    gen = torch.Generator().manual_seed(0)
    ckv = torch.randn(5, R + DR + 7, generator=gen)[:, : R + DR]  # a strided view, as the merged GEMM's split
    weight = torch.rand(R, generator=gen) + 0.5
    pages = torch.randn(6, LAYERS, BS, R + DR, generator=gen)
    slots = torch.tensor([3, 17, 40, 8, 47])
    want = pages.clone()
    want[slots // BS, 1, slots % BS] = torch.cat([rms_norm(ckv[:, :R], weight, 1e-6), ckv[:, R:]], -1)
    write(ckv, weight, 1e-6, pages, 1, slots)
    torch.testing.assert_close(pages, want, rtol=1e-6, atol=1e-6)
