"""The drafter's drafting step (greedy and sampled) over static buffers (hyserve/spec_decode/dspark_graphs.py), on the CPU: what
the graphs replay on CUDA drafts what the eager proposer drafts, whatever earlier steps left in the
buffers and however many padding requests the batch size adds. tests/gpu/test_dspark_graphs_gpu.py
checks the replay."""

from __future__ import annotations

import pytest
import torch
from test_dspark import features_of
from test_dspark_rows import VOCAB, toy_drafter, toy_target
from test_spec_engine import repetitive_prompts, run

from hyserve.spec_decode.dspark_graphs import DSparkGraphs, bytes_per_row, width_ladder
from hyserve.spec_decode.dspark_propose import DSparkProposer


@pytest.fixture(scope="module")
def target():
    return toy_target()


@pytest.fixture(scope="module")
def drafter(target):
    return toy_drafter(target)


def proposer_with(target, drafter, lengths: dict[str, int], seed: int) -> tuple[DSparkProposer, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    proposer = DSparkProposer(drafter, 3)
    anchors = []
    for rid, n in lengths.items():
        ids = torch.randint(3, VOCAB, (n,), generator=g).tolist()
        proposer.add_context(rid, features_of(target, ids[:-1], drafter.config.target_layer_ids),
                             torch.arange(len(ids) - 1))
        anchors.append(ids[-1])
    return proposer, torch.tensor(anchors)


def test_the_static_step_drafts_what_the_eager_proposer_drafts(target, drafter):
    graphs = DSparkGraphs(drafter, 3, [1, 2, 4, 8], width_ladder(600))
    # a first batch of long contexts leaves rows in the buffers that the second batch must not see
    for lengths in ({"a": 500, "b": 300, "c": 90}, {"d": 7, "e": 60, "f": 2, "g": 129, "h": 33}):
        proposer, anchors = proposer_with(target, drafter, lengths, seed=len(lengths))
        eager = proposer.propose(list(lengths), anchors)
        stores = [proposer.stores[r] for r in lengths]
        key = graphs.key_for(len(stores), max(s.n for s in stores))
        assert key[0] == (4 if len(lengths) == 3 else 8)  # padding requests
        static = graphs.draft(stores, anchors, key)
        assert static.probs is None and torch.equal(static.token_ids, eager.token_ids)
        torch.testing.assert_close(static.confidence, eager.confidence, rtol=0, atol=1e-6)


def test_the_proposer_drafts_greedy_blocks_through_its_graphs_and_sampled_ones_eagerly_without_sampled_graphs(
        target, drafter):
    proposer, anchors = proposer_with(target, drafter, {"a": 12, "b": 40}, seed=0)
    eager = proposer.propose(["a", "b"], anchors)
    proposer.graphs = graphs = DSparkGraphs(drafter, 3, [2], [128])
    calls, original = [], graphs.draft
    graphs.draft = lambda *a: calls.append(a[2]) or original(*a)
    assert torch.equal(proposer.propose(["a", "b"], anchors).token_ids, eager.token_ids)
    assert calls == [(2, 128, False)]
    block = proposer.propose(["a", "b"], anchors, [0.0, 0.9], [None, torch.Generator().manual_seed(1)])
    assert calls == [(2, 128, False)] and block.probs is not None


def seeded(seeds: list[int | None]) -> list[torch.Generator | None]:
    return [None if s is None else torch.Generator().manual_seed(s) for s in seeds]


def test_the_static_sampled_step_draws_what_the_eager_proposer_draws_from_the_same_seeds(target, drafter):
    graphs = DSparkGraphs(drafter, 3, [1, 2, 4], width_ladder(600), sampled=True)
    lengths, temps, seeds = {"a": 500, "b": 30, "c": 90}, [0.8, 0.0, 1.3], [7, None, 11]
    proposer, anchors = proposer_with(target, drafter, lengths, seed=4)
    eager = proposer.propose(list(lengths), anchors, temps, seeded(seeds))
    proposer.graphs = graphs
    calls, original = [], graphs.draft
    graphs.draft = lambda *a: calls.append(a[2]) or original(*a)
    static = proposer.propose(list(lengths), anchors, temps, seeded(seeds))
    assert calls == [(4, 512, True)]  # one padding request
    assert torch.equal(static.token_ids, eager.token_ids)
    torch.testing.assert_close(static.probs, eager.probs, rtol=0, atol=1e-6)
    torch.testing.assert_close(static.confidence, eager.confidence, rtol=0, atol=1e-6)
    # the greedy row drafts its argmax chain and a one-hot distribution, as a greedy block does
    greedy = proposer.propose(["b"], anchors[1:2])
    assert torch.equal(static.token_ids[1], greedy.token_ids[0])
    assert torch.equal(static.probs[1], torch.nn.functional.one_hot(greedy.token_ids[0], VOCAB).float())


def test_a_seeded_request_draws_the_same_drafts_whatever_else_is_in_the_batch(target, drafter):
    graphs = DSparkGraphs(drafter, 3, [1, 2, 4], width_ladder(200), sampled=True)
    proposer, anchors = proposer_with(target, drafter, {"a": 50, "b": 20, "c": 9}, seed=6)
    proposer.graphs = graphs
    alone = proposer.propose(["a"], anchors[:1], [1.0], seeded([3]))
    together = proposer.propose(["a", "b", "c"], anchors, [1.0, 0.7, 1.0], seeded([3, None, 5]))
    assert torch.equal(together.token_ids[0], alone.token_ids[0])


def test_sampled_graphs_stop_at_the_batch_whose_noise_fits_their_memory_budget(drafter, monkeypatch):
    import hyserve.spec_decode.dspark_graphs as dg
    monkeypatch.setattr(dg, "SAMPLED_BYTES", 2 * 4 * 3 * VOCAB * 2)  # noise + distributions of 2 requests
    graphs = DSparkGraphs(drafter, 3, [1, 2, 4], [128], sampled=True)
    assert graphs.key_for(2, 5, sampled=True) == (2, 128, True) and graphs.key_for(3, 5, sampled=True) is None
    assert graphs.key_for(4, 5) == (4, 128, False) and graphs.noise.shape[0] == 2


@pytest.mark.parametrize(("batch", "longest", "key"), [(1, 5, (1, 128, False)), (3, 129, (4, 256, False)),
                                                       (8, 512, (8, 512, False)),
                                                       (9, 5, None), (2, 513, None)])
def test_a_step_replays_the_smallest_key_that_holds_it(drafter, batch, longest, key):
    graphs = DSparkGraphs(drafter, 2, [1, 2, 4, 8], width_ladder(512))
    assert graphs.key_for(batch, longest) == key


def test_steps_over_the_row_budget_run_eagerly_and_the_buffers_hold_the_budget_at_most(drafter):
    graphs = DSparkGraphs(drafter, 2, [1, 2, 4, 8], width_ladder(4096), max_rows=1024)
    assert graphs.key_for(8, 100) == (8, 128, False) and graphs.key_for(1, 1000) == (1, 1024, False)
    assert graphs.key_for(2, 1000) is None and graphs.key_for(8, 200) is None  # 2 x 1024, 8 x 256 rows
    assert all(r.shape[0] <= 1024 for r in graphs.rows)
    assert DSparkGraphs(drafter, 2, [1, 2], [128], max_rows=64).key_for(1, 5) is None  # nothing fits
    c = drafter.config  # the budget's unit counts at least each layer's latent row
    assert bytes_per_row(drafter) > len(drafter.layers) * (c.kv_lora_rank + c.qk_rope_head_dim)


def test_the_width_ladder_covers_every_context_up_to_the_longest():
    assert width_ladder(100) == [128] and width_ladder(4096) == [128, 256, 512, 1024, 2048, 4096]
    assert width_ladder(4097) == [128, 256, 512, 1024, 2048, 4096, 8192]


def test_an_engine_with_static_buffers_drafts_greedy_blocks_through_the_static_step(make_llm, drafter_dir):
    prompts = repetitive_prompts(3, seed=5)
    kw = dict(max_num_seqs=4, enable_prefix_caching=False)
    plain = run(make_llm(**kw), prompts)
    llm = make_llm(static_decode_buffers=True, speculative_config={"method": "dspark", "model": drafter_dir}, **kw)
    graphs = llm.engine.spec.proposer.graphs
    assert graphs.batch_sizes == [1, 2, 4] and graphs.widths[-1] >= llm.engine.max_model_len
    keys, original = [], graphs.draft
    graphs.draft = lambda *a: keys.append(a[2]) or original(*a)
    assert run(llm, prompts) == plain
    assert keys and llm.engine.stats.spec_decode.num_draft_tokens > 0


def test_an_engine_with_static_buffers_draws_sampled_blocks_through_the_static_step_and_keeps_seeded_output(
        make_llm, drafter_dir):
    from hyserve import SamplingParams

    prompts = repetitive_prompts(3, seed=6)
    params = SamplingParams(max_tokens=16, temperature=0.9, seed=4, ignore_eos=True)
    spec = {"method": "dspark", "model": drafter_dir, "draft_sample_method": "probabilistic"}
    kw = dict(max_num_seqs=4, enable_prefix_caching=False, speculative_config=spec)
    eager = run(make_llm(**kw), prompts, params)
    llm = make_llm(static_decode_buffers=True, **kw)
    graphs = llm.engine.spec.proposer.graphs
    keys, original = [], graphs.draft
    graphs.draft = lambda *a: keys.append(a[2]) or original(*a)
    assert run(llm, prompts, params) == eager
    assert keys and all(k[2] for k in keys)


def test_sampled_drafts_of_a_bf16_drafter_carry_fp32_distributions_that_sum_to_one():
    """Rejection sampling divides by the draft distribution: it must be the one the race drew from, so
    the softmax and the Exp(1) draws stay fp32 whatever the drafter's dtype."""
    target = toy_target().to(torch.bfloat16)
    drafter = toy_drafter(target).to(torch.bfloat16)
    proposer, anchors = proposer_with(target, drafter, {"a": 30, "b": 9}, seed=2)
    block = proposer.propose(["a", "b"], anchors, [1.0, 0.7], seeded([1, 2]))
    assert block.probs.dtype == torch.float32
    torch.testing.assert_close(block.probs.sum(-1), torch.ones(2, 3), rtol=0, atol=1e-5)
