"""Decode CUDA graphs in the engine (engine/cuda_graphs.py) on a GPU: captured at engine start, replayed
for decode steps, and the same greedy tokens as the eager engine; --enforce-eager captures nothing."""

from __future__ import annotations

import pytest
import torch

from hyserve import EngineConfig, SamplingParams, envs
from hyserve.engine.llm_engine import LLMEngine
from hyserve.models.config import parse_config
from hyserve.models.device_init import random_init_on_device
from hyserve.models.loader import build_model, load_model
from hyserve.models.presets import preset_config

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
WIDE_INDEX = "k3.1-tiny+index128"


@pytest.fixture(scope="module")
def models():
    loaded = {}

    def get(name: str):
        if name not in loaded and name == WIDE_INDEX:
            # k3.1-tiny with 128-dim index keys: the indexer's FP8 tensor-core dot (D >= 32) inside graphs
            cfg = preset_config("k3.1-tiny")
            cfg.update(index_head_dim=128, index_n_heads=8)
            model = build_model(parse_config(cfg), torch.float32, "cuda")
            random_init_on_device(model, seed=0)
            loaded[name] = model
        if name not in loaded:
            loaded[name] = load_model(name, dtype="float32", device="cuda", seed=0)
        return loaded[name]

    return get


def _engine(model, name: str, **kw) -> LLMEngine:
    base = dict(model=name.split("+")[0], device="cuda", block_size=16, kv_cache_memory_bytes=64 << 20, max_num_seqs=8)
    return LLMEngine(EngineConfig(**dict(base, **kw)), model=model)


def _greedy(engine: LLMEngine, n: int) -> dict[str, list[int]]:
    for i in range(n):
        prompt = [(13 * i + 5 * j) % 500 + 1 for j in range(4 + 9 * i)]
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt},
                           SamplingParams(max_tokens=8 + 3 * i, temperature=0, ignore_eos=True))
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    engine.kv.check_empty()
    return done


@pytest.mark.parametrize("name", ["kimi-linear-tiny", "k3-tiny", "k3.1-tiny", WIDE_INDEX])
def test_graphed_decode_equals_eager_on_cuda(models, name):
    model = models(name)
    graphed = _engine(model, name)
    graphs = graphed.runner.graphs
    assert graphs is not None and graphs.sizes == [1, 2, 4, 8]
    # float32 tiny models: every size takes the sync-free kernels (Triton decode, MoE gemv), so all
    # of them must have been captured
    assert sorted(graphs.graphs) == [(1, 1), (2, 1), (4, 1), (8, 1)]
    replays, pending = [], []
    run = graphs.run
    graphs.run = lambda inputs, prev=None: replays.append(len(inputs.query_lens)) or pending.append(inputs.pending) or run(inputs, prev)
    eager = _engine(model, name, enforce_eager=True)
    for n in (1, 3, 5):  # 3 and 5 replay the graphs of 4 and 8 with padding rows
        got, ref = _greedy(graphed, n), _greedy(eager, n)
        assert got == ref, (n, got, ref)
        assert n in replays
    # async scheduling (the CUDA default): the graphs gathered the previous step's ids on the device
    assert graphed.cfg.async_scheduling and any(pending)


@pytest.mark.parametrize("name", ["kimi-linear-tiny", "k3-tiny"])
def test_graph_logits_match_eager_logits(models, name):
    """The replayed logits of one padded decode step against the eager step from the same cache."""
    model = models(name)
    # synchronous: with async scheduling (the CUDA default) the prefills' tokens would still be on the
    # device when the decode step below is scheduled, and execute() without them cannot run it. No prefix
    # caching: it splits a prompt at its last full page and before its last token (checkpoints there), and
    # the step after the first would then still be a prefill, not the decode step this test replays
    engine = _engine(model, name, async_scheduling=False, enable_prefix_caching=False)
    for i in range(3):
        engine.add_request(f"r{i}", {"prompt_token_ids": [(7 * i + j) % 500 + 1 for j in range(10 + 5 * i)]},
                           SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    engine.step()  # the prefills
    out = engine.scheduler.schedule()
    runner, t = engine.runner, engine.kv.tensors
    assert runner.uses_graph(out) and len(out.seqs) == 3
    saved = [x.clone() for x in (t.pages, t.conv, t.recurrent)]
    got = runner.execute(out).logits.clone()
    for x, s in zip((t.pages, t.conv, t.recurrent), saved):
        x.copy_(s)
    graphs, runner.graphs = runner.graphs, None
    ref = runner.execute(out).logits
    runner.graphs = graphs
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
    for rid in list(engine.parents):  # the step was never completed: abort frees what it scheduled
        engine.abort_request(rid)
    engine.kv.check_empty()


def test_graphs_are_the_default_on_cuda(models, monkeypatch):
    monkeypatch.setattr(envs, "get", lambda: envs.read({}))  # whatever this process's HYSERVE_CUDA_GRAPHS says
    engine = _engine(models("kimi-linear-tiny"), "kimi-linear-tiny")
    assert engine.runner.graphs is not None and engine.cfg.enforce_eager is False


def test_the_cuda_graphs_env_switch_is_an_alias_of_enforce_eager(models, monkeypatch):
    monkeypatch.setattr(envs, "get", lambda: envs.read({"HYSERVE_CUDA_GRAPHS": "0"}))
    engine = _engine(models("kimi-linear-tiny"), "kimi-linear-tiny")
    assert engine.runner.graphs is None and engine.cfg.enforce_eager is True


def test_enforce_eager_captures_nothing(models):
    model = models("kimi-linear-tiny")
    engine = _engine(model, "kimi-linear-tiny", enforce_eager=True)
    assert engine.runner.graphs is None and engine.kv.scratch_block is None and not engine.cache_plan.scratch
