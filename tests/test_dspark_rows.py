"""The drafter's row stores and padded context batches (hyserve/spec_decode/dspark_rows.py): padding to a
width bucket drafts what an unpadded forward drafts, and rows are written in place, on the CPU in fp32."""

from __future__ import annotations

import pytest
import torch
from test_dspark import features_of

from hyserve.spec_decode.dspark_propose import DSparkProposer, draft_block
from hyserve.spec_decode.dspark_rows import RowStore, width_bucket
from hyserve.train.dspark import DrafterTrainConfig, new_drafter
from hyserve.train.trainer import k3_config, new_model

VOCAB = 64


def toy_target():
    raw = k3_config("toy", VOCAB, 0, [1], 2, max_len=1024)
    return new_model(raw, "cpu", seed=0).eval().requires_grad_(False)


def toy_drafter(target):
    """Two draft layers (the row buffers are per layer), a Markov bias and confidence that are not zero."""
    d = new_drafter(target, DrafterTrainConfig(block_size=4, num_layers=2, layer_ids=[0, 2]), seed=1)
    with torch.no_grad():
        d.markov_out.weight.normal_(0, 0.5)
        d.confidence.weight.normal_(0, 0.5)
    return d.eval().requires_grad_(False)


@pytest.fixture(scope="module")
def target():
    return toy_target()


@pytest.fixture(scope="module")
def drafter(target):
    return toy_drafter(target)


def unpadded(drafter, rows: list[torch.Tensor], first: int, anchor: int, k: int):
    """The block one request drafts from exactly its own rows: width n, every row visible, no padding."""
    n = rows[0].shape[0]
    visible = torch.ones(1, drafter.config.block_size, n, dtype=torch.bool)
    with torch.no_grad():
        hidden = drafter.hidden(torch.tensor([[anchor]]), torch.tensor([[first + n]]),
                                [r.unsqueeze(0) for r in rows], visible)
    return draft_block(drafter, hidden, torch.tensor([anchor]), k)


def test_a_padded_batch_drafts_what_each_request_drafts_unpadded(target, drafter):
    g = torch.Generator().manual_seed(0)
    lengths = {"a": 2, "b": 6, "c": 40, "d": 130, "e": 300}  # widths around and across the buckets
    firsts = {"a": 0, "b": 3, "c": 0, "d": 17, "e": 0}  # some start past 0 (a prefix hit)
    proposer = DSparkProposer(drafter, 4)
    seqs = {r: torch.randint(3, VOCAB, (n,), generator=g).tolist() for r, n in lengths.items()}
    for rid, ids in seqs.items():
        feats = features_of(target, ids[:-1], drafter.config.target_layer_ids)
        proposer.add_context(rid, feats, torch.arange(firsts[rid], firsts[rid] + len(ids) - 1))
    anchors = torch.tensor([ids[-1] for ids in seqs.values()])
    batch = proposer.propose(list(seqs), anchors)
    for i, rid in enumerate(seqs):
        ref = unpadded(drafter, proposer.rows[rid], firsts[rid], seqs[rid][-1], 4)
        assert torch.equal(batch.token_ids[i], ref.token_ids[0]), rid
        # fp32 rounding only: the padded softmax and GEMMs sum in another order, the masked rows add 0
        torch.testing.assert_close(batch.confidence[i], ref.confidence[0], rtol=0, atol=1e-6)


def test_the_context_width_is_a_power_of_two_of_at_least_128():
    assert [width_bucket(n) for n in (1, 127, 128, 129, 256, 257, 3000)] == [128, 128, 128, 256, 256, 512, 4096]


def test_appends_within_capacity_write_in_place():
    store = RowStore(first=0)
    store.append([torch.randn(3, 8), torch.randn(3, 5)])
    ptrs, cap = [b.data_ptr() for b in store.buffers], store.capacity
    for _ in range(100):
        store.append([torch.randn(2, 8), torch.randn(2, 5)])
    assert cap == 256 and store.capacity == cap and [b.data_ptr() for b in store.buffers] == ptrs
    assert store.views()[0].shape == (203, 8) and store.views()[0].data_ptr() == ptrs[0]


def test_a_full_store_doubles_and_keeps_its_rows():
    store = RowStore(first=5)
    rows = torch.randn(300, 4)
    store.append([rows[:250]])
    assert store.capacity == 256
    store.append([rows[250:]])
    assert store.capacity == 512 and torch.equal(store.views()[0], rows)
    store.append([torch.randn(600, 4)])
    assert store.capacity == 1024 and store.n == 900  # doubled, or rounded up to 256 where that is more


def test_rows_after_a_truncation_are_overwritten_by_the_next_append():
    store = RowStore(first=0)
    store.append([torch.zeros(10, 2)])
    store.truncate(4)
    store.append([torch.ones(3, 2)])
    assert store.n == 7 and torch.equal(store.views()[0][4:], torch.ones(3, 2))
    assert not store.views()[0][:4].any()


def test_the_proposer_keeps_one_store_per_request_across_appends(target, drafter):
    proposer = DSparkProposer(drafter, 2)
    feats = features_of(target, list(range(3, 23)), drafter.config.target_layer_ids)
    proposer.add_context("r", feats[:5], torch.arange(5))
    ptr = proposer.rows["r"][0].data_ptr()
    for p in range(5, 20):
        proposer.add_context("r", feats[p : p + 1], torch.tensor([p]))
    assert proposer.rows["r"][0].data_ptr() == ptr and proposer.num_context("r") == 20
    alone = drafter.context_rows(feats, torch.arange(20))
    for got, want in zip(proposer.rows["r"], alone):
        torch.testing.assert_close(got, want)  # row-count-dependent GEMM rounding only


def test_rows_queued_for_several_requests_are_computed_in_one_drafter_call(target, drafter, monkeypatch):
    proposer, calls = DSparkProposer(drafter, 2), []
    original = drafter.context_rows
    monkeypatch.setattr(drafter, "context_rows", lambda f, p: calls.append(p.tolist()) or original(f, p))
    feats = features_of(target, list(range(3, 13)), drafter.config.target_layer_ids)
    proposer.add_context("a", feats[:4], torch.arange(4))
    proposer.add_context("b", feats[:6], torch.arange(2, 8))
    assert proposer.num_context("a") == 4 and proposer.num_context("b") == 8 and not calls
    proposer.flush()
    assert calls == [[0, 1, 2, 3, 2, 3, 4, 5, 6, 7]]
    for rid, n, first in (("a", 4, 0), ("b", 6, 2)):
        want = original(feats[:n], torch.arange(first, first + n))
        for got, w in zip(proposer.rows[rid], want):
            torch.testing.assert_close(got, w)


def test_context_positions_must_be_consecutive(target, drafter):
    proposer = DSparkProposer(drafter, 2)
    feats = features_of(target, [3, 4, 5], drafter.config.target_layer_ids)
    with pytest.raises(ValueError, match="consecutive"):
        proposer.add_context("r", feats, torch.tensor([0, 1, 3]))


def test_a_freed_request_leaves_no_queued_rows(target, drafter):
    proposer = DSparkProposer(drafter, 2)
    feats = features_of(target, [3, 4, 5], drafter.config.target_layer_ids)
    proposer.add_context("r", feats, torch.arange(3))
    proposer.free("r")
    proposer.add_context("r", feats[:1], torch.tensor([7]))  # a new start after a prefix hit
    assert proposer.num_context("r") == 8 and proposer.rows["r"][0].shape[0] == 1


def test_greedy_drafts_carry_no_distributions_and_follow_the_argmax_chain(drafter):
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(3, drafter.config.block_size, drafter.config.hidden_size, generator=g)
    anchors = torch.tensor([5, 9, 11])
    block = draft_block(drafter, hidden, anchors, 4)
    assert block.probs is None
    prev = anchors
    for j in range(4):
        prev = (drafter.base_logits(hidden[:, j]) + drafter.markov_bias(prev)).argmax(-1)
        assert torch.equal(block.token_ids[:, j], prev)
