"""The DSpark drafter's drafting step (greedy and sampled) on a GPU (spec_decode/dspark_graphs.py, dspark_propose.py): the replayed
graphs draft what the eager proposer drafts, the eager step makes no host round trip before its one
read-back, and an engine with graphs replays them and keeps plain decoding's greedy output.
tests/test_dspark_graphs.py checks the static buffers on the CPU."""

from __future__ import annotations

import pytest
import torch
from test_dspark import features_of
from test_dspark_rows import VOCAB, toy_drafter, toy_target
from test_spec_engine import repetitive_prompts, run

from hyserve import LLM
from hyserve.spec_decode.dspark_graphs import DSparkGraphs, width_ladder
from hyserve.spec_decode.dspark_propose import DSparkProposer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module")
def cuda_pair():
    target = toy_target().cuda()
    return target, toy_drafter(target).cuda()


def filled(target, drafter, lengths: list[int], seed: int) -> tuple[DSparkProposer, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    proposer, anchors = DSparkProposer(drafter, 3), []
    for i, n in enumerate(lengths):
        ids = torch.randint(3, VOCAB, (n,), generator=g).tolist()
        feats = features_of(target, ids[:-1], drafter.config.target_layer_ids)
        proposer.add_context(f"r{i}", feats, torch.arange(n - 1))
        anchors.append(ids[-1])
    return proposer, torch.tensor(anchors)


def test_replayed_drafter_graphs_draft_what_the_eager_proposer_drafts(cuda_pair):
    target, drafter = cuda_pair
    graphs = DSparkGraphs(drafter, 3, [1, 2, 4], width_ladder(400))
    graphs.capture()
    assert set(graphs.graphs) == {(b, w, False) for b in (1, 2, 4) for w in (128, 256, 512)}
    for lengths in ([300, 20, 140], [5], [2, 9, 60, 130]):  # the first leaves rows the later ones must not see
        proposer, anchors = filled(target, drafter, lengths, seed=len(lengths))
        eager = proposer.propose([f"r{i}" for i in range(len(lengths))], anchors)
        proposer.graphs = graphs
        replayed = proposer.propose([f"r{i}" for i in range(len(lengths))], anchors)
        assert torch.equal(replayed.token_ids, eager.token_ids)
        torch.testing.assert_close(replayed.confidence, eager.confidence, rtol=0, atol=1e-5)


def seeded(seeds: list[int | None]) -> list[torch.Generator | None]:
    return [None if s is None else torch.Generator("cuda").manual_seed(s) for s in seeds]


def test_replayed_sampled_drafter_graphs_draw_what_the_eager_proposer_draws_from_the_same_seeds(cuda_pair):
    target, drafter = cuda_pair
    graphs = DSparkGraphs(drafter, 3, [1, 2, 4], width_ladder(400), sampled=True)
    graphs.capture()
    assert {(b, w, True) for b in (1, 2, 4) for w in (128, 256, 512)} <= set(graphs.graphs)
    temps = [0.9, 0.0, 1.2]
    for lengths in ([300, 20, 140], [2, 9, 60]):  # the first leaves rows and noise the second must not see
        proposer, anchors = filled(target, drafter, lengths, seed=len(lengths) + sum(lengths))
        rids = [f"r{i}" for i in range(len(lengths))]
        eager = proposer.propose(rids, anchors, temps, seeded([5, None, 8]))
        proposer.graphs = graphs
        replayed = proposer.propose(rids, anchors, temps, seeded([5, None, 8]))
        assert torch.equal(replayed.token_ids, eager.token_ids)
        torch.testing.assert_close(replayed.probs, eager.probs, rtol=0, atol=1e-5)
        torch.testing.assert_close(replayed.confidence, eager.confidence, rtol=0, atol=1e-5)


def test_the_eager_drafting_step_does_not_wait_for_the_device(cuda_pair):
    """Adding rows and drafting a greedy block launch work only: a stream sync (a pageable host-to-device
    copy, a read of a device value) raises under the sync debug mode."""
    target, drafter = cuda_pair
    proposer, anchors = filled(target, drafter, [50, 7], seed=3)
    proposer.propose(["r0", "r1"], anchors)  # the first step builds what is built once (rope tables, kernels)
    feats = features_of(target, list(range(3, 9)), drafter.config.target_layer_ids)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        proposer.add_context("r1", feats, torch.arange(6, 12))
        block = proposer.propose(["r0", "r1"], anchors)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert block.token_ids.shape == (2, 3) and block.probs is None


def test_an_engine_with_graphs_replays_the_drafter_graphs_and_keeps_the_greedy_output(drafter_dir):
    kw = dict(device="cuda", dtype="float32", max_num_seqs=4, block_size=16, kv_cache_memory_bytes=64 << 20,
              enable_prefix_caching=False)
    spec = {"method": "dspark", "model": drafter_dir, "confidence_threshold": 0}  # every block verified
    prompts = repetitive_prompts(3, seed=5) + [list(range(40, 90))]
    plain = run(LLM("k3-tiny", enforce_eager=True, **kw), prompts)
    llm = LLM("k3-tiny", speculative_config=spec, **kw)
    graphs = llm.engine.spec.proposer.graphs
    assert graphs.graphs and set(graphs.graphs) == {(b, w, False) for b in graphs.batch_sizes for w in graphs.widths}
    replays, original = [], graphs.draft
    graphs.draft = lambda *a: replays.append(a[2]) or original(*a)
    assert run(llm, prompts) == plain
    assert replays and all(k in graphs.graphs for k in replays)
    assert llm.engine.stats.spec_decode.num_draft_tokens > 0
