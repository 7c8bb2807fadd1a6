"""The MLP segment graphs of prefill and mixed steps (models/segment_graphs.py) on a GPU: every (layer,
size) captured for a bf16 model, a replayed mixed step equal to the eager forward up to bf16 rounding with
its padding rows still zero, and an engine that captures them and serves long prompts."""

from __future__ import annotations

import pytest
import torch

from hyserve import EngineConfig, SamplingParams
from hyserve.engine.llm_engine import LLMEngine
from hyserve.models.batch import Batch
from hyserve.models.loader import load_model
from hyserve.models.segment_graphs import SegmentGraphs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module")
def models():
    loaded = {}

    def get(name: str):
        if name not in loaded:
            loaded[name] = load_model(name, dtype="bfloat16", device="cuda", seed=0)
        return loaded[name]

    return get


def _step(model, seed: int):
    gen = torch.Generator("cuda").manual_seed(seed)
    batch = Batch.build([1, 299], [41, 329], [[0, 1, 2], list(range(3, 24))], 16, [0, 1], [False, False], "cuda")
    cache = model.make_cache(24, 16, 2)
    cache.pages.normal_(generator=gen)
    cache.conv.normal_(generator=gen)
    cache.recurrent.normal_(0, 0.1, generator=gen)
    ids = torch.randint(0, model.config.vocab_size, (300,), generator=gen, device="cuda")
    return ids, batch, cache


@pytest.mark.parametrize("name", ["kimi-linear-tiny", "k3-tiny"])  # plain residuals; Block AttnRes
@torch.inference_mode()
def test_a_replayed_mixed_step_equals_the_eager_forward(models, name):
    model = models(name)
    segs = SegmentGraphs(model, [256, 512]).capture()
    assert len(segs.graphs) == 2 * len(model.model.layers)
    ids, batch, cache = _step(model, 0)
    eager = model(ids, batch, cache).float()
    ids, batch, cache = _step(model, 0)
    segs.x.fill_(float("nan"))  # whatever the buffers held before: the step's padding rows are zeroed
    if segs.blocks is not None:
        segs.blocks.fill_(float("nan"))
    got = model(ids, batch, cache, segments=segs)
    assert got.data_ptr() == segs.h.data_ptr()
    err = (got.float() - eager).norm() / eager.norm()
    assert err < 2e-2, err
    assert torch.count_nonzero(segs.x[300:512]) == 0
    if segs.blocks is not None:
        assert torch.count_nonzero(segs.blocks[:, 300:512]) == 0


def test_an_engine_captures_the_segments_and_serves_long_prompts(models):
    model = models("kimi-linear-tiny")
    engine = LLMEngine(EngineConfig(model="kimi-linear-tiny", device="cuda", block_size=16,
                                    kv_cache_memory_bytes=64 << 20, max_num_seqs=4, max_num_batched_tokens=1024),
                       model=model)
    assert sorted({n for _, n in engine.runner.segments.graphs}) == [256, 512, 768, 1024]  # the ladder ends at the token budget
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    for i, n in enumerate((290, 600)):
        engine.add_request(str(i), {"prompt_token_ids": [(7 * j + i) % 500 + 1 for j in range(n)]}, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    assert sorted(done) == ["0", "1"] and all(len(t) == 4 for t in done.values())
    engine.kv.check_empty()
