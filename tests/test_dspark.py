"""The DSpark drafter (hyserve/spec_decode/dspark*.py), its target features and its training
(hyserve/train/dspark*.py), on a toy K3 target on the CPU."""

from __future__ import annotations

import random

import pytest
import torch

from hyserve.sampling_params import SamplingParams
from hyserve.spec_decode.dspark_io import load_drafter, save_drafter, target_info
from hyserve.spec_decode.dspark_propose import DSparkProposer, draft_block
from hyserve.spec_decode.ngram import NgramProposer
from hyserve.spec_decode.reference_loop import dspark_propose, ngram_propose, speculative_generate
from hyserve.spec_decode.target_features import default_layer_ids, tap_features
from hyserve.train.dspark import DrafterTrainConfig, new_drafter, train_drafter
from hyserve.train.dspark_loss import context_visible
from hyserve.train.trainer import k3_config, new_model

VOCAB = 64


@pytest.fixture(scope="module")
def target():
    raw = k3_config("toy", VOCAB, 0, [1], 2, max_len=512)
    return new_model(raw, "cpu", seed=0).eval().requires_grad_(False)


@pytest.fixture(scope="module")
def drafter(target):
    d = new_drafter(target, DrafterTrainConfig(block_size=4, num_layers=1, layer_ids=[0, 2]), seed=1)
    with torch.no_grad():  # a Markov bias and confidence that are not zero, so the tests see them
        d.markov_out.weight.normal_(0, 0.5)
        d.confidence.weight.normal_(0, 0.5)
    return d.eval().requires_grad_(False)


def features_of(target, ids, layer_ids):
    with tap_features(target, layer_ids) as tap:
        target.score(ids)
    return tap.features()


# ---- target features -------------------------------------------------------------------------------


def test_tapping_features_leaves_the_target_output_unchanged(target):
    ids = list(range(3, 20))
    plain = target.score(ids)
    with tap_features(target, [0, 3]) as tap:
        tapped = target.score(ids)
    assert torch.equal(plain, tapped)
    assert tap.features().shape == (len(ids), 2 * target.config.hidden_size)


def test_the_last_layer_feature_is_the_hidden_state_before_the_final_norm(target):
    ids = list(range(5, 15))
    last = target.config.num_hidden_layers - 1
    feats = features_of(target, ids, [last])
    logits = target.compute_logits(target.model.norm(feats))
    assert torch.allclose(logits, target.score(ids), atol=1e-5)


def test_target_layers_out_of_range_are_an_error(target):
    with pytest.raises(ValueError, match="out of range"):
        with tap_features(target, [target.config.num_hidden_layers]):
            pass


def test_default_layers_spread_from_layer_one_to_three_before_the_end():
    assert default_layer_ids(8) == [1, 3, 5]
    assert default_layer_ids(36, 5) == [1, 9, 17, 25, 33]


# ---- the drafter -------------------------------------------------------------------------------------


def test_the_drafter_owns_no_copy_of_the_target_embedding_or_head(target, drafter):
    state = drafter.state_dict()
    assert not any(n.startswith(("embed_tokens", "lm_head")) for n in state)
    shared = {target.model.embed_tokens.weight.data_ptr(), target.lm_head.weight.data_ptr()}
    assert not any(t.data_ptr() in shared for t in state.values())
    assert drafter.base_logits(torch.zeros(1, drafter.config.hidden_size)).shape[-1] == VOCAB


def test_a_block_sees_only_context_before_its_anchor(target, drafter):
    ids = list(range(3, 23))
    feats = features_of(target, ids, drafter.config.target_layer_ids)
    pos = torch.arange(len(ids))
    anchor_pos = torch.tensor([[10]])
    vis = context_visible(anchor_pos, drafter.config.block_size, len(ids))

    def hidden(f):
        rows = [r.unsqueeze(0) for r in drafter.context_rows(f, pos)]
        return drafter.hidden(torch.tensor([[ids[10]]]), anchor_pos, rows, vis)

    base = hidden(feats)
    later = feats.clone()
    later[10:] += 1.0  # the anchor's own position and after: not yet known when drafting
    assert torch.allclose(hidden(later), base)
    earlier = feats.clone()
    earlier[9] += 1.0
    assert not torch.allclose(hidden(earlier), base)


def test_draft_confidence_reads_the_token_before_not_the_draft(drafter):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, drafter.config.block_size, drafter.config.hidden_size, generator=g)
    anchors = torch.tensor([5, 9, 11])
    block = draft_block(drafter, hidden, anchors, 4, [0.0, 1.0, 0.7], [None, torch.Generator().manual_seed(3), None])
    prev = torch.cat([anchors.unsqueeze(1), block.token_ids[:, :-1]], 1)
    for j in range(4):
        want = torch.sigmoid(drafter.confidence_logits(hidden[:, j], prev[:, j]))
        assert torch.allclose(block.confidence[:, j], want)


def test_drafts_come_with_the_distribution_they_were_drawn_from(drafter):
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(2, drafter.config.block_size, drafter.config.hidden_size, generator=g)
    anchors = torch.tensor([4, 7])
    block = draft_block(drafter, hidden, anchors, 3, [0.0, 0.8])
    prev = torch.cat([anchors.unsqueeze(1), block.token_ids[:, :-1]], 1)
    base = drafter.base_logits(hidden[:, :3])
    for j in range(3):
        logits = base[:, j] + drafter.markov_bias(prev[:, j])
        assert block.probs[0, j].argmax() == block.token_ids[0, j] == logits[0].argmax()
        assert block.probs[0, j].max() == 1.0  # greedy row: one-hot
        assert torch.allclose(block.probs[1, j], (logits[1] / 0.8).softmax(-1), atol=1e-6)
        assert block.probs[1, j, block.token_ids[1, j]] > 0


def test_a_batch_of_requests_drafts_as_each_would_alone(target, drafter):
    """Padding a short context to the batch's longest changes nothing (the mask hides the padding)."""
    seqs = {"a": list(range(3, 9)), "b": list(range(10, 30)), "c": [5, 6]}
    batch = DSparkProposer(drafter, 3)
    for rid, ids in seqs.items():
        feats = features_of(target, ids[:-1], drafter.config.target_layer_ids)
        batch.add_context(rid, feats, torch.arange(len(ids) - 1))
    anchors = torch.tensor([ids[-1] for ids in seqs.values()])
    together = batch.propose(list(seqs), anchors)
    for i, rid in enumerate(seqs):
        alone = batch.propose([rid], anchors[i : i + 1])
        assert torch.equal(alone.token_ids[0], together.token_ids[i])
        assert torch.allclose(alone.confidence[0], together.confidence[i], atol=1e-6)


def test_context_rows_must_arrive_in_order(target, drafter):
    proposer = DSparkProposer(drafter, 2)
    feats = features_of(target, [3, 4, 5], drafter.config.target_layer_ids)
    proposer.add_context("r", feats[:2], torch.arange(2))
    with pytest.raises(ValueError, match="in order"):
        proposer.add_context("r", feats[2:], torch.tensor([5]))
    with pytest.raises(ValueError, match="block size"):
        DSparkProposer(drafter, drafter.config.block_size + 1)


def test_save_and_load_round_trip(tmp_path, target, drafter):
    save_drafter(drafter, str(tmp_path), target_info(target, "toy"), dtype=torch.float32)
    loaded = load_drafter(str(tmp_path), target)
    for (name, a), (_, b) in zip(drafter.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name
    with pytest.raises(ValueError, match="no config.json"):
        load_drafter(str(tmp_path / "missing"), target)


def test_loading_a_non_drafter_or_a_drafter_for_another_target_is_an_error(tmp_path, target, drafter):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text('{"model_type": "kimi_k3"}')
    with pytest.raises(ValueError, match="not a DSpark drafter"):
        load_drafter(str(tmp_path / "model"), target)
    info = dict(target_info(target, "toy"), num_hidden_layers=8)
    save_drafter(drafter, str(tmp_path / "other"), info)
    with pytest.raises(ValueError, match="trained for another target: num_hidden_layers 8"):
        load_drafter(str(tmp_path / "other"), target)


def test_greedy_speculative_generation_equals_plain_greedy(target, drafter):
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    prompt = [7, 8, 9, 7, 8, 9, 7, 3, 4]
    plain, _ = speculative_generate(target, prompt, 12, greedy, lambda s, p, g: ([], None))
    dspark = dspark_propose(target, DSparkProposer(drafter, 3))
    with_drafter, stats = speculative_generate(target, prompt, 12, greedy, dspark)
    ngram = ngram_propose(NgramProposer(1, 3, 4, 512))
    with_ngram, _ = speculative_generate(target, prompt, 12, greedy, ngram)
    assert with_drafter == plain and with_ngram == plain
    assert stats.num_drafts > 0 and stats.num_draft_tokens >= stats.num_accepted_tokens

    def oracle(seq, params, generator):  # the right next tokens, every third one wrong
        done = len(seq) - len(prompt)
        drafts = plain[done : done + 4]
        return [t if (done + j) % 3 else (t + 1) % VOCAB for j, t in enumerate(drafts)], None

    with_oracle, stats = speculative_generate(target, prompt, 12, greedy, oracle)
    assert with_oracle == plain
    assert stats.num_accepted_tokens >= 4 and stats.mean_acceptance_length > 1.5


# ---- training ---------------------------------------------------------------------------------------


def test_training_lowers_the_loss(target):
    rng = random.Random(0)
    pattern = [rng.randrange(3, VOCAB) for _ in range(12)]
    examples = [((pattern * 6)[i : i + 40], [1] * 40) for i in range(12)]
    cfg = DrafterTrainConfig(block_size=4, num_layers=1, anchors=8, rows=2, row_len=48, max_steps=30,
                             log_every=5, lr=3e-3, warmup_steps=3)
    _, log = train_drafter(target, examples, cfg, pad_id=2, progress=False)
    assert log.steps == 30
    assert sum(log.losses[-2:]) / 2 < 0.8 * sum(log.losses[:2]) / 2, log.losses


def test_the_target_pass_under_bf16_autocast_gives_float_logits(target, monkeypatch):
    # on CUDA the training forward runs under bf16 autocast over fp32 weights, so the hidden rows come out
    # in bf16; the head must run under the same autocast (outside it, bf16 rows met fp32 weights)
    from hyserve.train.dspark import TargetPass

    monkeypatch.setattr(TargetPass, "autocast", lambda self: torch.autocast("cpu", dtype=torch.bfloat16))
    tp = TargetPass(target, [0, 2], rows=2, row_len=16, use_fla=False)
    ids = torch.randint(3, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    feats, logits = tp(ids, torch.tensor([[2, 5], [1, 7]]), 4)
    assert logits.dtype == torch.float32 and logits.shape == (2, 2, 4, VOCAB)
    assert feats.shape[:2] == (2, 16)
