"""A KDA layer step with speculative verify rows, run once on the layer's reference path and once on the
GPU fast path (`kda_fast.kda_forward_fast`), for tests/test_kda_fast_verify_interpret.py (Triton's CPU
interpreter) and tests/gpu/test_kda_fast_verify_gpu.py (CUDA). Prefill chunks only on CUDA: the fast
path's prefills need fla, which the CPU has not."""

from __future__ import annotations

import copy
import dataclasses
from collections import Counter

import torch

from hyserve.models.batch import Batch, CacheTensors, VerifyRows
from hyserve.models.config import parse_config
from hyserve.models.layers.kda import KimiDeltaAttention
from hyserve.models.presets import preset_config
from hyserve.ops.kernel_plan import REFERENCE, KernelPlan

SPEC_K = 3  # num_speculative_tokens: slot rows of 1 + K columns
# (kind, query length, src column, fresh): verify rows of lengths 3, 2 and 3 (two calls, one of them for two
# sequences, in an order that is not the step's), a plain decode and a fresh one between them
STEP = [("verify", 3, 1, False), ("decode", 1, 0, False), ("verify", 2, 0, False), ("decode", 1, 0, True),
        ("verify", 3, 2, False)]
# the same with prefill chunks (fla: CUDA only), one continuing a sequence and one fresh
STEP_WITH_PREFILLS = STEP[:2] + [("prefill", 37, 0, False)] + STEP[2:] + [("prefill", 20, 0, True)]
FAST = KernelPlan(kda_decode="triton", kda_verify="triton")  # kernels for decode and verify rows, no fla


def _random(name: str, shape: torch.Size, gen: torch.Generator) -> torch.Tensor:
    if name == "A_log":
        return torch.log(torch.rand(shape, generator=gen) * 3 + 0.5)
    r = torch.randn(shape, generator=gen)
    scale = {"dt_bias": 0.5, "o_norm_weight": 0.2, "conv_weight": 0.5}.get(name, shape[-1] ** -0.5)
    return r * scale + (name == "o_norm_weight")


def kda_layer(preset: str, dtype: torch.dtype, device: str, seed: int) -> KimiDeltaAttention:
    """KDA layer 0 of `preset` with random weights: projections in `dtype`, the fp32 parameters kept fp32
    (as the loader keeps them)."""
    layer = KimiDeltaAttention(parse_config(preset_config(preset)), 0)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, w in layer.named_parameters():
            w.copy_(_random(name, w.shape, gen))
    layer = layer.to(device)
    for m in layer.modules():
        if isinstance(m, torch.nn.Linear):
            m.to(dtype)
    return layer


def verify_step(layer: KimiDeltaAttention, dtype: torch.dtype, device: str, seed: int, step=STEP):
    """(x, batch, cache) of `step`: every slot random (a fresh sequence's NaN: it must never be read)."""
    gen = torch.Generator().manual_seed(seed)
    h, k, w = layer.num_heads, layer.head_dim, layer.conv_weight.shape[1]
    slots = 2 * (1 + SPEC_K) * len(step)
    order = torch.randperm(slots, generator=gen).tolist()  # slots unordered, with gaps
    tables, state_slots = [], []
    for kind, _, src, _ in step:
        if kind == "verify":
            tables.append([order.pop() for _ in range(1 + SPEC_K)])
            state_slots.append(tables[-1][src])
        else:
            state_slots.append(order.pop())
    qlens, fresh = [q for _, q, _, _ in step], [f for *_, f in step]
    ctx = [q + 5 * (not f) for q, f in zip(qlens, fresh)]
    # KDA reads no page: every table row is block 0, as many times as the context needs
    batch = Batch.build(qlens, ctx, [[0] * -(-c // 16) for c in ctx], 16, state_slots, fresh, device)
    batch.verify = VerifyRows([i for i, s in enumerate(step) if s[0] == "verify"], torch.tensor(tables, device=device),
                              torch.tensor([s[2] for s in step if s[0] == "verify"], device=device))
    conv = torch.randn(slots, 1, 3 * h * k, w - 1, generator=gen).to(dtype)
    rec = torch.randn(slots, 1, h, k, k, generator=gen) * 0.3
    for s, f in zip(state_slots, fresh):
        if f:
            conv[s], rec[s] = float("nan"), float("nan")
    cache = CacheTensors(torch.zeros(1, 1, 16, 1, dtype=dtype, device=device), conv.to(device), rec.to(device))
    x = torch.randn(sum(qlens), layer.q_proj.in_features, generator=gen).to(device, dtype)
    return x, batch, cache


def run_both(layer: KimiDeltaAttention, x: torch.Tensor, batch: Batch, cache: CacheTensors, monkeypatch,
             plan: KernelPlan = FAST):
    """(reference output, its cache, fast output, its cache, the kernels the fast path called). The
    reference is `plan` without the verify kernel: the layer's reference path for the whole step."""
    from hyserve.models.layers import kda_fast

    calls: Counter = Counter()

    def counted(name, fn):
        def wrapped(*args, **kw):
            calls[name if name == "decode" else (name, args[-1])] += 1
            return fn(*args, **kw)
        return wrapped

    monkeypatch.setattr(kda_fast, "kda_decode", counted("decode", kda_fast.kda_decode))
    monkeypatch.setattr(kda_fast, "kda_verify_multi", counted("verify", kda_fast.kda_verify_multi))
    ref_cache = copy.deepcopy(cache)
    with torch.inference_mode():
        ref = layer(x, batch, ref_cache, dataclasses.replace(plan, kda_verify=REFERENCE))
        assert not calls, "a plan without the verify kernel must run the step on the reference path"
        out = layer(x, batch, cache, plan)
    return ref, ref_cache, out, cache, calls


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    assert torch.isfinite(a).all(), "non-finite values in the fast result"
    return float((a - b).norm() / b.norm().clamp_min(1e-30))
