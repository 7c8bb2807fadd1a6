"""An MLA layer step with speculative verify rows, plain decodes and a prefill chunk, run on the layer's
reference path and on its GPU path (`MLAttention._attend_fast`), for tests/test_mla_fast_verify_interpret.py
(Triton's CPU interpreter) and tests/gpu/test_mla_fast_verify_gpu.py (CUDA)."""

from __future__ import annotations

import copy
import random

import torch

from hyserve.models.batch import Batch, CacheTensors, VerifyRows
from hyserve.models.config import parse_config
from hyserve.models.layers.mla import MLAttention
from hyserve.models.presets import preset_config
from hyserve.ops import mla_decode
from hyserve.ops.kernel_plan import KernelPlan

BS = 4
FAST = KernelPlan(mla="merged")  # presets without rope: the merged q|kv_a GEMM and row write
# (kind, query length, context after the step): verify rows of 3 and 4 tokens, plain decodes, one of them
# the sequence's first token
STEP = [("verify", 3, 14), ("decode", 1, 9), ("verify", 4, 6), ("decode", 1, 1)]
STEP_WITH_PREFILL = STEP[:2] + [("prefill", 5, 12)] + STEP[2:]


def layer_of(preset: str, seed: int, device: str = "cpu", dtype: torch.dtype = torch.float32) -> MLAttention:
    layer = MLAttention(parse_config(preset_config(preset)), 0)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for w in layer.parameters():
            w.copy_(torch.randn(w.shape, generator=gen) * w.shape[-1] ** -0.5 + (w.dim() == 1))
    return layer.eval().to(device, dtype)


def step_of(layer: MLAttention, step, seed: int, block_size: int = BS) -> tuple[torch.Tensor, Batch, CacheTensors]:
    """Pages of random earlier rows in a shuffled block order; the step writes its own rows."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-c // block_size) for _, _, c in step]
    order = list(range(sum(need) + 2))
    random.Random(seed).shuffle(order)
    tables = [[order.pop() for _ in range(n)] for n in need]
    qlens, ctx = [q for _, q, _ in step], [c for *_, c in step]
    dev, dtype = layer.kv_b_proj.weight.device, layer.kv_b_proj.weight.dtype
    batch = Batch.build(qlens, ctx, tables, block_size, [0] * len(step), [False] * len(step), dev)
    verify = [i for i, s in enumerate(step) if s[0] == "verify"]
    batch.verify = VerifyRows(verify, torch.zeros(len(verify), 5, dtype=torch.long, device=dev),
                              torch.zeros(len(verify), dtype=torch.long, device=dev))
    pages = torch.randn(sum(need) + 2, 1, block_size, layer.rank + layer.dr, generator=gen).to(dev, dtype)
    cache = CacheTensors(pages, torch.zeros(1, 1, 1, 1, device=dev), torch.zeros(1, 1, 1, 1, 1, device=dev))
    x = torch.randn(sum(qlens), layer.kv_a_proj_with_mqa.in_features, generator=gen).to(dev, dtype)
    return x, batch, cache


def run(layer, x, batch, cache, monkeypatch, plan: KernelPlan = FAST):
    """(reference output, its pages, fast output, its pages, the rows each fast kernel was called with)."""
    calls = {"decode": [], "prefill": []}
    for name, fn in (("decode", mla_decode.mla_absorbed_decode_fast), ("prefill", mla_decode.mla_prefill_fast)):
        def spy(*args, _fn=fn, _name=name, **kw):
            calls[_name].append(args[0].shape[0])
            return _fn(*args, **kw)
        monkeypatch.setattr(mla_decode, f"mla_{'absorbed_decode' if name == 'decode' else 'prefill'}_fast", spy)
    ref_cache = copy.deepcopy(cache)
    with torch.inference_mode():
        ref = layer(x, batch, ref_cache, KernelPlan())
        out = layer(x, batch, cache, plan)
    return ref, ref_cache.pages, out, cache.pages, calls
