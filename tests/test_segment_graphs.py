"""The MLP halves of prefill and mixed steps through the segment graphs' static buffers
(hyserve/models/segment_graphs.py), run on the CPU where the "graph" is the same padded segment without a
capture: the same hidden states and greedy output as the eager forward, padding rows that stay zero, and
eager steps for every step the ladder does not cover."""

from __future__ import annotations

import pytest
import torch

from hyserve import SamplingParams
from hyserve.models import segment_graphs
from hyserve.models.batch import Batch
from hyserve.models.segment_graphs import SegmentGraphs, segment_graph_sizes


def test_the_ladder_ends_at_the_token_budget_in_steps_of_at_most_an_eighth():
    assert segment_graph_sizes(8192) == [*range(256, 4096, 256), *range(4096, 8193, 512)]
    assert segment_graph_sizes(1000) == [256, 512, 768, 1000]
    assert segment_graph_sizes(8194)[-2:] == [8192, 8194]
    assert segment_graph_sizes(1 << 20)[-1] == 16384
    assert segment_graph_sizes(100) == []


MODELS = ["kimi-linear-tiny", "k3-tiny", "k3.1-tiny"]  # plain residuals; Block AttnRes; AttnRes + DSA


def test_kimi_models_take_segment_graphs_and_other_modules_do_not(tiny_model):
    assert all(segment_graphs.supports(tiny_model(name)[0]) for name in MODELS)
    assert not segment_graphs.supports(torch.nn.Linear(2, 2))


def _mixed_step(model, gen):
    # a decode over 40 cached tokens, then a 299-token chunk over 30 cached ones: 300 tokens, size 512
    batch = Batch.build([1, 299], [41, 329], [[0, 1, 2], list(range(3, 24))], 16, [0, 1], [False, False])
    cache = model.make_cache(24, 16, 2)
    cache.pages.normal_(generator=gen)
    cache.conv.normal_(generator=gen)
    cache.recurrent.normal_(0, 0.1, generator=gen)
    return torch.randint(0, model.config.vocab_size, (300,), generator=gen), batch, cache


@pytest.fixture
def model(tiny_model):
    return tiny_model("kimi-linear-tiny")[0]


@pytest.mark.parametrize("name", MODELS)
def test_a_mixed_step_through_the_segments_equals_the_eager_forward(tiny_model, name):
    model = tiny_model(name)[0]
    ids, batch, cache = _mixed_step(model, torch.Generator().manual_seed(0))
    states = [t.clone() for t in (cache.pages, cache.conv, cache.recurrent)]
    with torch.inference_mode():
        eager = model(ids, batch, cache)
        cache.pages.copy_(states[0]), cache.conv.copy_(states[1]), cache.recurrent.copy_(states[2])
        segs = SegmentGraphs(model, [256, 512])
        for buf in (segs.x, segs.a, segs.h, segs.blocks):  # whatever a step before left in them
            if buf is not None:
                buf.fill_(float("nan"))
        got = model(ids, batch, cache, segments=segs)
    assert got.data_ptr() == segs.h.data_ptr()  # the step ran through the buffers
    torch.testing.assert_close(got, eager, rtol=1e-5, atol=1e-5)
    assert torch.count_nonzero(segs.x[300:512]) == 0  # padding rows stay zero through every layer
    if segs.blocks is not None:
        assert torch.count_nonzero(segs.blocks[:, 300:512]) == 0


def test_steps_off_the_ladder_or_under_another_plan_run_eagerly(model):
    segs = SegmentGraphs(model, [256, 512])
    assert segs.size_for(255, segs.plan) is None and segs.size_for(513, segs.plan) is None
    assert segs.size_for(256, segs.plan) == 256 and segs.size_for(300, segs.plan) == 512
    assert segs.size_for(300, segs.plan.for_training()) is None


@pytest.mark.parametrize("name", MODELS)
def test_an_engine_with_graphs_gives_the_eager_greedy_output_for_long_prompts(make_engine, name):
    prompts = [{"prompt_token_ids": [3 + (7 * j + n) % 500 for j in range(n)]} for n in (290, 40, 530)]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)

    def run(static: bool) -> list[list[int]]:
        engine = make_engine(name, static, block_size=16, max_num_batched_tokens=1024)
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, params)
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
        return [done[str(i)] for i in range(len(prompts))], engine

    eager, _ = run(False)
    calls = []
    original = SegmentGraphs.after_attention
    SegmentGraphs.after_attention = lambda self, i, a: calls.append(i) or original(self, i, a)
    try:
        graphed, engine = run(True)
    finally:
        SegmentGraphs.after_attention = original
    assert engine.runner.segments is not None and calls  # prefill steps ran through the segments
    assert graphed == eager


def test_an_engine_whose_drafter_taps_target_layers_keeps_its_steps_eager(make_engine, drafter_dir):
    # forward hooks read the features, and a replay runs no hooks: the drafter would get the capture's
    engine = make_engine("k3-tiny", True, speculative_config={"method": "dspark", "model": drafter_dir})
    assert engine.runner.segments is None
    assert make_engine("k3-tiny", True).runner.segments is not None
