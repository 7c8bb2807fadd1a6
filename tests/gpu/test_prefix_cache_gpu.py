"""Hybrid prefix caching on CUDA: the same invariants as tests/test_prefix_cache.py with the GPU paths
(device tensors, pinned CPU tier, batched host<->device copies)."""

from __future__ import annotations

import random

import pytest
import torch

from hyserve import EngineConfig, SamplingParams
from hyserve.engine.llm_engine import LLMEngine
from hyserve.models.loader import load_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
PARAMS = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return load_model("k3-tiny", dtype="float32", device="cuda", seed=0)


def _engine(model, **kw) -> LLMEngine:
    base = dict(model="k3-tiny", device="cuda", block_size=16, kv_cache_memory_bytes=32 << 20)
    return LLMEngine(EngineConfig(**dict(base, **kw)), model=model)


def _generate(engine: LLMEngine, prompt: list[int], rid: str):
    engine.add_request(rid, {"prompt_token_ids": prompt}, PARAMS)
    while True:
        for out in engine.step():
            if out.finished:
                return out


def test_cpu_tier_round_trip_on_cuda_gives_identical_outputs(model):
    rng = random.Random(0)
    prompt, other = [rng.randrange(1, 250) for _ in range(150)], [rng.randrange(1, 250) for _ in range(150)]
    cont = prompt + [rng.randrange(1, 250) for _ in range(20)]
    ref = _generate(_engine(model, enable_prefix_caching=False), cont, "ref")
    engine = _engine(model, num_checkpoint_slots=1, num_gpu_blocks=20, prefix_cache_second_hit=False,
                     prefix_cache_end_of_generation=False, cpu_offload_bytes=8 << 20)
    pc = engine.kv.prefix
    assert pc.cpu.pages[0].is_pinned()
    _generate(engine, prompt, "a")
    _generate(engine, other, "b")
    hit = _generate(engine, cont, "c")
    assert hit.num_cached_tokens == 149 and pc.cpu_hits == 149 and pc.cpu.pages_in > 0
    assert hit.outputs[0].token_ids == ref.outputs[0].token_ids
    engine.kv.check_empty()


def test_multi_turn_outputs_match_with_the_cache_off_on_cuda(model):
    def run(engine):
        rng, outs = random.Random(1), []
        ctx = [[rng.randrange(1, 250) for _ in range(60)] for _ in range(4)]
        for turn in range(4):
            for i in range(4):
                o = _generate(engine, ctx[i], f"{turn}-{i}")
                outs.append((o.outputs[0].token_ids, o.num_cached_tokens))
                ctx[i] = ctx[i] + o.outputs[0].token_ids + [rng.randrange(1, 250) for _ in range(9)]
        return outs

    off, on = run(_engine(model, enable_prefix_caching=False)), run(_engine(model))
    assert [t for t, _ in on] == [t for t, _ in off]
    assert sum(c for _, c in on) > 0
