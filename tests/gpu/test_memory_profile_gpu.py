"""The profile run on a GPU (hyserve/planning/memory_profile.py): an engine sized from free memory measures
its largest steps' peak before it sizes the cache, and a real step of the whole token budget allocates no
more than that."""

from __future__ import annotations

import pytest
import torch

from hyserve import EngineConfig, SamplingParams
from hyserve.engine.llm_engine import LLMEngine
from hyserve.models.loader import load_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
BUDGET = 1024


@pytest.fixture(scope="module")
def model():
    return load_model("k3-tiny", dtype="bfloat16", device="cuda", seed=0)


def _engine(model, **kw) -> LLMEngine:
    # a tenth of the card: the cache is sized from what is free, as `hyserve serve` sizes it
    base = dict(model="k3-tiny", device="cuda", gpu_memory_utilization=0.1, max_num_batched_tokens=BUDGET,
                max_num_seqs=8, warmup=False)
    return LLMEngine(EngineConfig(**dict(base, **kw)), model=model)


def _step_peak(engine: LLMEngine, prompts: list[list[int]]) -> int:
    """The allocator's high-water mark above what was in use while the prompts are served."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    for i, p in enumerate(prompts):
        engine.add_request(f"p{i}", {"prompt_token_ids": p}, SamplingParams(max_tokens=2, temperature=0.8, top_p=0.9))
    while engine.has_unfinished_requests():
        engine.step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def test_an_engine_sized_from_free_memory_profiles_its_largest_steps(model):
    engine = _engine(model, enforce_eager=True)
    assert engine.memory_profile is not None
    assert engine.memory_profile.peak_bytes > 0 and engine.memory_profile.num_steps >= 3


def test_an_engine_given_its_cache_bytes_runs_no_profile(model):
    assert _engine(model, enforce_eager=True, kv_cache_memory_bytes=64 << 20).memory_profile is None


@pytest.mark.parametrize("shape", [(BUDGET,), (256,) * 4, (BUDGET // 2, BUDGET // 2)])
def test_a_step_of_the_whole_token_budget_stays_within_the_profiled_peak(model, shape):
    engine = _engine(model, enforce_eager=True)
    prompts = [[(7 * i + 3 * j) % 500 + 1 for j in range(n)] for i, n in enumerate(shape)]
    assert _step_peak(engine, prompts) <= engine.memory_profile.peak_bytes


def test_a_speculating_engine_with_graphs_serves_a_full_budget_within_the_profiled_peak(model):
    engine = _engine(model, speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                                "confidence_threshold": 0})
    prompts = [[(5 * i + j % 7) % 500 + 1 for j in range(BUDGET // 8)] for i in range(8)]
    assert _step_peak(engine, prompts) <= engine.memory_profile.peak_bytes
