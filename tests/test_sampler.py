import math
import random

import pytest
import torch

from hyserve.engine.sampler import (
    Sampler,
    SamplingMetadata,
    apply_penalties,
    apply_top_k_top_p,
    compute_prompt_logprobs,
    logprob_dicts,
    seeded_generator,
)
from hyserve.outputs import Logprob
from hyserve.sampling_params import SamplingParams

EOS = 3


def metadata(params, outputs=None, prompts=None, generators=None, eos=(EOS,)):
    n = len(params)
    if generators is None:
        generators = [None if p.seed is None else seeded_generator(p.seed, "cpu") for p in params]
    return SamplingMetadata.build(
        params, outputs or [[] for _ in range(n)], prompts or [[] for _ in range(n)], generators, "cpu", eos
    )


def sample(logits, params, mask=None, **kwargs):
    return Sampler()(logits, metadata(params, **kwargs), mask)


def spaced_logits(n, vocab, seed=0):
    """Rows whose logits are a shuffled 0, 0.1, 0.2, ...: a unique argmax with a clear gap."""
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(vocab, generator=g).float() * 0.1 for _ in range(n)])


def draw_frequencies(probs, params, draws=20000):
    torch.manual_seed(0)
    logits = torch.tensor(probs).log().expand(draws, -1).contiguous()
    tokens = sample(logits, [params] * draws).token_ids
    return torch.bincount(tokens, minlength=len(probs)).float() / draws


def chi_square(observed_freq, expected_probs, draws=20000):
    expected = torch.tensor(expected_probs) * draws
    observed = observed_freq * draws
    keep = expected > 0
    return float(((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum())


# ---- greedy and its limits ------------------------------------------------------------------------


def test_greedy_takes_the_argmax():
    logits = torch.randn(6, 50)
    out = sample(logits, [SamplingParams(temperature=0.0)] * 6)
    assert torch.equal(out.token_ids, logits.argmax(-1))


def test_greedy_ties_go_to_the_lowest_id():
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0, 2.0]])
    assert sample(logits, [SamplingParams(temperature=0.0)]).token_ids.item() == 1


def test_an_all_greedy_batch_builds_no_temperature_or_greedy_mask():
    """Neither is read when every row is greedy: two host-to-device copies fewer per decode step."""
    greedy = metadata([SamplingParams(temperature=0.0)] * 3)
    assert greedy.all_greedy and greedy.temperature is None and greedy.is_greedy is None
    mixed = metadata([SamplingParams(temperature=0.0), SamplingParams(temperature=0.7)])
    assert mixed.is_greedy.tolist() == [True, False] and mixed.temperature.tolist() == pytest.approx([1.0, 0.7])


def test_temperature_near_zero_is_greedy():
    logits = spaced_logits(8, 40)
    out = sample(logits, [SamplingParams(temperature=1e-3)] * 8)
    assert torch.equal(out.token_ids, logits.argmax(-1))


def test_top_k_one_is_greedy():
    torch.manual_seed(1)
    logits = torch.randn(64, 30)
    out = sample(logits, [SamplingParams(top_k=1)] * 64)
    assert torch.equal(out.token_ids, logits.argmax(-1))


def test_tiny_top_p_is_greedy():
    torch.manual_seed(2)
    logits = torch.randn(64, 30)
    out = sample(logits, [SamplingParams(top_p=1e-6)] * 64)
    assert torch.equal(out.token_ids, logits.argmax(-1))


def test_greedy_and_random_rows_mix_in_one_batch():
    torch.manual_seed(3)
    logits = spaced_logits(4, 20)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(),
        SamplingParams(temperature=0.0),
        SamplingParams(),
    ]
    out = sample(logits, params)
    assert out.token_ids[0] == logits[0].argmax() and out.token_ids[2] == logits[2].argmax()


# ---- distributions ------------------------------------------------------------------------------

PROBS = [0.1, 0.2, 0.3, 0.4]


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        (SamplingParams(), PROBS),
        # p^(1/T) renormalised: T = 0.5 squares the probabilities.
        (SamplingParams(temperature=0.5), [p * p / 0.3 for p in PROBS]),
        (SamplingParams(top_k=2), [0.0, 0.0, 3 / 7, 4 / 7]),
        # Sorted mass before each token: 0.4 -> 0, 0.3 -> 0.4, 0.2 -> 0.7: keep the first two.
        (SamplingParams(top_p=0.6), [0.0, 0.0, 3 / 7, 4 / 7]),
        # min_p 0.6 of the top probability 0.4 = 0.24: keep 0.3 and 0.4.
        (SamplingParams(min_p=0.6), [0.0, 0.0, 3 / 7, 4 / 7]),
    ],
    ids=["plain", "temperature", "top_k", "top_p", "min_p"],
)
def test_sampling_frequencies_match_the_processed_distribution(params, expected):
    freq = draw_frequencies(PROBS, params)
    removed = torch.tensor(expected) == 0
    assert freq[removed].sum() == 0
    # df <= 3; 99.9% quantile is 16.3.
    assert chi_square(freq, expected) < 20


def test_min_p_keeps_only_tokens_near_the_top():
    probs = [0.5, 0.3, 0.15, 0.05]
    freq = draw_frequencies(probs, SamplingParams(min_p=0.35), draws=4000)
    assert freq[2] == 0 and freq[3] == 0
    assert freq[0] > 0 and freq[1] > 0


def test_top_k_shortcut_matches_the_full_sort():
    torch.manual_seed(7)
    logits = torch.randn(4, 100)
    top_k = torch.tensor([1, 5, 20, 7])
    top_p = torch.tensor([1.0, 0.5, 0.9, 0.3])
    full = apply_top_k_top_p(logits, top_k, top_p)
    shortcut = apply_top_k_top_p(logits, top_k, top_p, max_top_k=20)
    assert torch.equal(full, shortcut)


def test_top_k_shortcut_needs_a_k_on_every_sampled_row():
    assert metadata([SamplingParams(top_k=5), SamplingParams(top_k=9)]).max_top_k == 9
    assert metadata([SamplingParams(top_k=5), SamplingParams(temperature=0.0)]).max_top_k == 5
    assert metadata([SamplingParams(top_k=5), SamplingParams()]).max_top_k is None


# ---- penalties, bias, masks ---------------------------------------------------------------------


def penalised(params, outputs, prompts):
    md = metadata([params], outputs=[outputs], prompts=[prompts])
    logits = torch.tensor([[2.0, -1.0, 0.5, 1.0]])
    return apply_penalties(
        logits,
        md.output_token_ids,
        md.prompt_token_ids,
        md.presence_penalty,
        md.frequency_penalty,
        md.repetition_penalty,
    )[0].tolist()


def test_presence_penalty_subtracts_once_per_generated_token():
    assert penalised(SamplingParams(presence_penalty=0.5), [0, 0, 2], [3]) == [1.5, -1.0, 0.0, 1.0]


def test_frequency_penalty_scales_with_generated_count():
    assert penalised(SamplingParams(frequency_penalty=0.5), [0, 0, 2], [3]) == [1.0, -1.0, 0.0, 1.0]


def test_presence_and_frequency_ignore_prompt_tokens():
    assert penalised(SamplingParams(presence_penalty=1.0, frequency_penalty=1.0), [], [0, 3]) == [
        2.0,
        -1.0,
        0.5,
        1.0,
    ]


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits():
    # Token 0 was generated, token 1 is in the prompt; 2 and 3 are unseen.
    assert penalised(SamplingParams(repetition_penalty=2.0), [0], [1]) == [1.0, -2.0, 0.5, 1.0]


def test_penalty_changes_the_greedy_choice():
    logits = torch.tensor([[1.0, 0.9, 0.0, 0.0]])
    params = SamplingParams(temperature=0.0, presence_penalty=0.5)
    assert sample(logits, [params], outputs=[[0]]).token_ids.item() == 1


def test_penalties_apply_per_row():
    logits = torch.tensor([[1.0, 0.9, 0.0, 0.0]] * 2)
    params = [SamplingParams(temperature=0.0, frequency_penalty=1.0), SamplingParams(temperature=0.0)]
    assert sample(logits, params, outputs=[[0], [0]]).token_ids.tolist() == [1, 0]


def test_logit_bias_is_added_to_its_row_only():
    logits = torch.tensor([[0.0, 0.0, 0.0, 1.0]] * 2)
    params = [SamplingParams(temperature=0.0, logit_bias={2: 5.0}), SamplingParams(temperature=0.0)]
    assert sample(logits, params).token_ids.tolist() == [2, 3]


def test_min_tokens_masks_eos_until_reached():
    logits = torch.tensor([[0.0, 1.0, 0.0, 9.0]])
    params = SamplingParams(temperature=0.0, min_tokens=2)
    assert sample(logits, [params], outputs=[[1]]).token_ids.item() == 1
    assert sample(logits, [params], outputs=[[1, 1]]).token_ids.item() == EOS


def test_min_tokens_masks_stop_token_ids():
    logits = torch.tensor([[0.0, 1.0, 9.0, 0.0]])
    params = SamplingParams(temperature=0.0, min_tokens=1, stop_token_ids=[2])
    assert sample(logits, [params]).token_ids.item() == 1


def test_min_tokens_leaves_eos_alone_when_eos_is_ignored():
    logits = torch.tensor([[0.0, 1.0, 0.0, 9.0]])
    params = SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True)
    assert sample(logits, [params]).token_ids.item() == EOS


def test_allowed_token_mask_forbids_tokens():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    mask = torch.tensor([[True, True, False, False]])
    assert sample(logits, [SamplingParams(temperature=0.0)], mask=mask).token_ids.item() == 1


def test_allowed_token_mask_overrides_logit_bias():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    mask = torch.tensor([[True, True, False, True]])
    params = SamplingParams(temperature=0.0, logit_bias={2: 100.0})
    assert sample(logits, [params], mask=mask).token_ids.item() == 3


def test_input_logits_are_not_modified():
    logits = torch.randn(2, 10)
    before = logits.clone()
    sample(logits, [SamplingParams(temperature=0.5, top_k=3, presence_penalty=1.0)] * 2, outputs=[[1], [2]])
    assert torch.equal(logits, before)


# ---- seeds --------------------------------------------------------------------------------------


def seeded_sequence(target_logits, seed, others, steps=20, rng=None):
    """Draw `steps` tokens for one seeded request, with `others` random rows shuffled around it."""
    generator = seeded_generator(seed, "cpu")
    params = SamplingParams(seed=seed, top_k=40, top_p=0.95)
    tokens = []
    for _ in range(steps):
        rows = [("target", target_logits, params, generator)]
        for j in range(others):
            rows.append(
                ("other", torch.randn_like(target_logits), SamplingParams(temperature=0.8 + j / 10), None)
            )
        if rng is not None:
            rng.shuffle(rows)
        logits = torch.stack([r[1] for r in rows])
        md = metadata([r[2] for r in rows], generators=[r[3] for r in rows])
        out = Sampler()(logits, md).token_ids
        tokens.append(out[[r[0] for r in rows].index("target")].item())
    return tokens


def test_same_seed_gives_same_tokens_whatever_the_batch():
    target = torch.randn(64, generator=torch.Generator().manual_seed(7))
    alone = seeded_sequence(target, seed=1234, others=0)
    crowded = seeded_sequence(target, seed=1234, others=5, rng=random.Random(0))
    reordered = seeded_sequence(target, seed=1234, others=5, rng=random.Random(1))
    assert alone == crowded == reordered
    assert len(set(alone)) > 1  # the request really sampled


def test_different_seeds_give_different_tokens():
    target = torch.randn(64, generator=torch.Generator().manual_seed(7))
    assert seeded_sequence(target, seed=1, others=0) != seeded_sequence(target, seed=2, others=0)


def test_seeded_request_without_generator_is_rejected():
    with pytest.raises(ValueError, match="generator"):
        metadata([SamplingParams(seed=5)], generators=[None])


def test_greedy_rows_do_not_consume_their_generator():
    md = metadata([SamplingParams(temperature=0.0, seed=5)])
    assert md.generators == {}


def test_out_of_range_logit_bias_is_rejected_when_vocab_is_known():
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingMetadata.build(
            [SamplingParams(logit_bias={10: 1.0})], [[]], [[]], [None], "cpu", [], vocab_size=10
        )


# ---- logprobs -----------------------------------------------------------------------------------


def test_logprobs_are_raw_log_softmax_of_the_sampled_token():
    torch.manual_seed(4)
    logits = torch.randn(8, 30)
    params = SamplingParams(temperature=0.5, top_k=5, presence_penalty=2.0, logprobs=0)
    out = sample(logits, [params] * 8, outputs=[[0, 1]] * 8)
    expected = logits.log_softmax(-1).gather(1, out.token_ids[:, None]).squeeze(1)
    torch.testing.assert_close(out.logprobs, expected)


def test_ranks_are_one_based_positions_in_the_raw_distribution():
    logits = torch.tensor([[0.5, 3.0, 1.0, 2.0]])
    # Bias forces token 2, the third most likely under the raw logits.
    out = sample(logits, [SamplingParams(temperature=0.0, logit_bias={2: 10.0}, logprobs=0)])
    assert out.token_ids.item() == 2 and out.ranks.item() == 3
    assert sample(logits, [SamplingParams(temperature=0.0, logprobs=0)]).ranks.item() == 1


def test_top_logprobs_use_the_largest_k_in_the_batch():
    torch.manual_seed(5)
    logits = torch.randn(3, 30)
    out = sample(logits, [SamplingParams(logprobs=2), SamplingParams(logprobs=5), SamplingParams()])
    expected_lp, expected_ids = logits.log_softmax(-1).topk(5, dim=-1)
    assert torch.equal(out.top_token_ids, expected_ids)
    torch.testing.assert_close(out.top_logprobs, expected_lp)


def test_no_top_logprobs_when_no_row_asks():
    out = sample(torch.randn(2, 10), [SamplingParams(), SamplingParams(logprobs=0)])
    assert out.top_token_ids is None and out.top_logprobs is None


def test_logprobs_reflect_the_allowed_token_mask():
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, False, False]])
    out = sample(logits, [SamplingParams(temperature=0.0, logprobs=0)], mask=mask)
    assert out.logprobs.item() == pytest.approx(math.log(0.5))


def test_no_logprobs_are_computed_when_no_row_asks():
    out = sample(torch.randn(2, 10), [SamplingParams(), SamplingParams(temperature=0.0)])
    assert out.logprobs is None and out.ranks is None and out.top_token_ids is None


def test_sampling_leaves_the_callers_logits_unchanged():
    logits = torch.randn(2, 10)
    before = logits.clone()
    sample(logits, [SamplingParams(temperature=0.7, top_p=0.5, min_p=0.1), SamplingParams(temperature=0.0)])
    sample(logits, [SamplingParams(logit_bias={1: 5.0}), SamplingParams(min_tokens=3)])
    assert torch.equal(logits, before)


def test_prompt_logprobs_equal_log_softmax_gather():
    torch.manual_seed(6)
    logits = torch.randn(7, 30)
    next_ids = torch.randint(0, 30, (7,))
    result = compute_prompt_logprobs(logits, next_ids, k=3)
    logprobs = logits.log_softmax(-1)
    torch.testing.assert_close(result.token_logprobs, logprobs.gather(1, next_ids[:, None]).squeeze(1))
    expected_ranks = (logprobs > result.token_logprobs[:, None]).sum(-1) + 1
    assert torch.equal(result.ranks, expected_ranks)
    assert torch.equal(result.top_token_ids, logprobs.topk(3, dim=-1).indices)


def test_prompt_logprobs_without_top_k():
    result = compute_prompt_logprobs(torch.randn(2, 5), torch.tensor([1, 2]), k=0)
    assert result.top_token_ids is None and result.top_logprobs is None


def test_logprob_dicts_put_the_chosen_token_first_then_each_rows_top_k():
    rows = logprob_dicts(
        token_ids=[7, 2],
        logprobs=[-2.0, -0.1],
        ranks=[3, 1],
        top_token_ids=[[2, 5], [2, 5]],
        top_logprobs=[[-0.5, -1.0], [-0.1, -3.0]],
        num_logprobs=[2, 0],
    )
    assert rows[0] == {7: Logprob(-2.0, 3), 2: Logprob(-0.5, 1), 5: Logprob(-1.0, 2)}
    assert list(rows[0]) == [7, 2, 5]
    assert rows[1] == {2: Logprob(-0.1, 1)}
