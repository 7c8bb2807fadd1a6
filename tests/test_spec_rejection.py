"""Rejection sampling of verify steps (hyserve/spec_decode/rejection.py): greedy output is the target's
argmax chain; sampled output is exactly the target distribution at every position, whatever the drafter
proposes; sampling masks are never violated; seeded requests are reproducible; logprobs come from the
target."""

from __future__ import annotations

import pytest
import torch
from spec_util import chi_square_pvalue

from hyserve.engine.sampler import Sampler, SamplingMetadata, seeded_generator
from hyserve.sampling_params import SamplingParams
from hyserve.spec_decode.rejection import REJECTED, rejection_sample
from hyserve.spec_decode.target_probs import SpecRequest

V = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=100)


def req(drafts, params=GREEDY, outputs=(), generator=None):
    return SpecRequest(params, list(outputs), [1, 2], generator, list(drafts))


def peaked(argmaxes, vocab=V):
    """One row per entry with a clear argmax there."""
    rows = torch.zeros(len(argmaxes), vocab)
    rows[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 5.0
    return rows


# ---- greedy ---------------------------------------------------------------------------------------


def test_greedy_accepts_every_matching_draft_and_appends_the_bonus():
    out = rejection_sample(peaked([1, 2, 3, 4]), [req([1, 2, 3])])
    assert out.token_lists() == [[1, 2, 3, 4]] and out.num_accepted.tolist() == [3]


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0, max_tokens=100, logit_bias={1: -100.0}),
                                    SamplingParams(temperature=0.0, max_tokens=100, repetition_penalty=100.0)])
def test_greedy_verdicts_see_the_bias_and_penalties_that_move_the_argmax(params):
    """Token 1 leads each row by a little, token 3 follows: banned (or penalised, having been generated), 1
    loses to 3 and the draft 1 is rejected; the raw logits alone would accept it."""
    rows = torch.zeros(2, V)
    rows[:, 1], rows[:, 3] = 3.0, 2.5
    out = rejection_sample(rows, [req([1], params, outputs=[1])])
    assert out.token_lists() == [[3]] and out.num_accepted.tolist() == [0]
    assert rejection_sample(rows, [req([1], outputs=[1])]).token_lists() == [[1, 1]]


def test_greedy_stops_at_the_first_mismatch_with_the_target_argmax():
    out = rejection_sample(peaked([1, 5, 3, 4]), [req([1, 2, 3])])
    assert out.token_lists() == [[1, 5]]
    assert out.output_token_ids.tolist() == [[1, 5, REJECTED, REJECTED]]


def test_greedy_mixed_batch_with_a_request_without_drafts():
    logits = torch.cat([peaked([0, 0]), peaked([2]), peaked([3, 1, 4])])
    out = rejection_sample(logits, [req([4]), req([]), req([3, 1])])
    assert out.token_lists() == [[0], [2], [3, 1, 4]]
    assert out.num_accepted.tolist() == [0, 0, 2]


def plain_chain(logits, params, outputs, drafts) -> list[int]:
    """What plain greedy decode steps emit at these rows: row j after the outputs and the tokens before."""
    chain = []
    for j in range(len(drafts) + 1):
        meta = SamplingMetadata.build([params], [outputs + chain], [[1, 2]], [None], "cpu", ())
        chain.append(int(Sampler()(logits[j : j + 1], meta).token_ids[0]))
        if j == len(drafts) or chain[-1] != drafts[j]:
            break
    return chain


def test_greedy_equals_the_plain_decode_argmax_chain_under_penalties():
    """Each row's argmax is taken after the penalties of the output plus the draft prefix, as a plain
    decode step would see it after emitting those tokens; drafts that follow the chain reach the bonus."""
    g = torch.Generator().manual_seed(3)
    params = SamplingParams(temperature=0.0, repetition_penalty=1.8, presence_penalty=0.7, max_tokens=100)
    for trial in range(20):
        logits = torch.randn(5, V, generator=g)
        outputs = [trial % V]
        random_drafts = torch.randint(0, V, (4,), generator=g).tolist()
        followed = plain_chain(logits, params, outputs, [-1] * 4)[:1]
        for j in range(1, 4):  # drafts equal to the chain so far: every one is accepted
            followed = plain_chain(logits, params, outputs, followed + [-1] * (4 - j))[: j + 1]
        for drafts in (random_drafts, followed):
            out = rejection_sample(logits, [req(drafts, params, outputs=outputs)]).token_lists()[0]
            assert out == plain_chain(logits, params, outputs, drafts)
        assert len(rejection_sample(logits, [req(followed, params, outputs=outputs)]).token_lists()[0]) == 5


# ---- sampled: exact in distribution ---------------------------------------------------------------

TARGET = torch.tensor([[2.0, 1.5, 0.3, -1.0, 0.9, -0.4],
                       [0.1, 2.2, 1.0, 0.5, -2.0, 1.7],
                       [-0.5, 0.0, 2.4, 1.1, 0.8, -1.2],
                       [1.2, -0.3, 0.4, 2.0, 0.6, 1.0]])  # 3 draft rows and the bonus row
# wrong where it matters: too much mass on the target's second choice and on tokens the target's
# top-k/top-p masks remove, too little on its first choice
WRONG_DRAFTER = torch.tensor([[0.25, 0.45, 0.05, 0.1, 0.1, 0.05],
                              [0.1, 0.3, 0.3, 0.05, 0.05, 0.2],
                              [0.05, 0.05, 0.4, 0.3, 0.1, 0.1]])
SAMPLED = SamplingParams(temperature=0.8, top_k=5, top_p=0.9, max_tokens=100)
TRIALS = 12000


def processed(row: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The target distribution the test expects: temperature, then the k best, then the top-p prefix."""
    p = (row / params.temperature).softmax(-1)
    order = p.argsort(descending=True)
    keep = torch.zeros(V, dtype=torch.bool)
    keep[order[: params.top_k]] = True
    p = torch.where(keep, p, 0.0)
    p = p / p.sum()
    sorted_p = p[order]
    before = sorted_p.cumsum(0) - sorted_p
    keep = torch.zeros(V, dtype=torch.bool)
    keep[order[before < params.top_p]] = True
    p = torch.where(keep, p, 0.0)
    return p / p.sum()


def run_trials(drafter: torch.Tensor | None, seed: int, params=SAMPLED):
    """TRIALS requests of 3 drafts each; drafter None: greedy (one-hot) drafts of the wrong drafter."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    q = WRONG_DRAFTER if drafter is None else drafter
    drafts = torch.stack([torch.multinomial(q[j], TRIALS, replacement=True, generator=g) for j in range(3)], 1)
    if drafter is None:
        drafts = q.argmax(-1).expand(TRIALS, 3)
    requests = [req(d, params) for d in drafts.tolist()]
    logits = TARGET.repeat(TRIALS, 1)
    probs = None if drafter is None else q.repeat(TRIALS, 1)
    return rejection_sample(logits, requests, probs)


def per_position_pvalues(out) -> list[float]:
    tokens, m = out.output_token_ids, out.num_accepted
    pvalues = []
    for j in range(4):
        reached = m >= j  # position j is emitted exactly when the drafts before it were accepted
        counts = torch.bincount(tokens[reached, j], minlength=V)
        expected = processed(TARGET[j], SAMPLED)
        assert int(counts[expected == 0].sum()) == 0, f"position {j} emitted a masked token"
        assert int(reached.sum()) > 500
        pvalues.append(chi_square_pvalue(counts, expected))
    return pvalues


def test_sampled_output_is_the_target_distribution_at_every_draft_position_and_the_bonus():
    pvalues = per_position_pvalues(run_trials(WRONG_DRAFTER, seed=0))
    assert min(pvalues) > 1e-4, pvalues


def test_sampled_output_with_one_hot_drafts_is_the_target_distribution():
    pvalues = per_position_pvalues(run_trials(None, seed=1))
    assert min(pvalues) > 1e-4, pvalues


def test_the_chi_square_check_rejects_a_sampler_that_recovers_from_the_target_instead_of_the_residual():
    """The test's power: the recovered token drawn from p (not max(0, p - q)) is caught at position 0."""
    out = run_trials(WRONG_DRAFTER, seed=2)
    tokens, m = out.output_token_ids, out.num_accepted
    g = torch.Generator().manual_seed(5)
    p0 = processed(TARGET[0], SAMPLED)
    wrong = torch.where(m == 0, torch.multinomial(p0, TRIALS, replacement=True, generator=g), tokens[:, 0])
    assert chi_square_pvalue(torch.bincount(wrong, minlength=V), p0) < 1e-6


def test_top_k_and_top_p_masks_are_never_violated_even_by_drafts_outside_them():
    params = SamplingParams(temperature=1.5, top_k=2, top_p=0.7, max_tokens=100)
    out = run_trials(WRONG_DRAFTER, seed=3, params=params)
    allowed = [processed(TARGET[j], params) > 0 for j in range(4)]
    for row, n in zip(out.output_token_ids.tolist(), (out.num_accepted + 1).tolist()):
        assert all(allowed[j][row[j]] for j in range(n))


def test_drafts_equal_to_the_target_are_always_accepted():
    p = torch.stack([processed(TARGET[j], SAMPLED) for j in range(3)])
    drafts = torch.stack([p[j].argmax() for j in range(3)]).tolist()
    out = rejection_sample(TARGET, [req(drafts, SAMPLED)], p)
    assert out.num_accepted.tolist() == [3]


def test_a_mixed_batch_judges_each_request_by_its_own_settings():
    """Greedy rows follow the argmax chain even with draft distributions present; sampled rows in the same
    call keep their masks; a request without drafts just samples its bonus row."""
    p = torch.stack([processed(TARGET[j], SAMPLED) for j in range(3)])
    greedy_drafts = TARGET[:3].argmax(-1).tolist()
    greedy_drafts[2] = (greedy_drafts[2] + 1) % V  # the third is wrong
    requests = [req(greedy_drafts), req([0, 1, 2], SAMPLED), req([], SAMPLED)]
    logits = torch.cat([TARGET, TARGET, TARGET[3:]])
    probs = torch.cat([WRONG_DRAFTER, WRONG_DRAFTER])
    torch.manual_seed(0)
    out = rejection_sample(logits, requests, probs).token_lists()
    assert out[0] == TARGET[:3].argmax(-1).tolist()
    assert all(p[j][t] > 0 for j, t in enumerate(out[1][:3]))
    assert len(out[2]) == 1 and processed(TARGET[3], SAMPLED)[out[2][0]] > 0


# ---- seeds, logprobs, synthetic -------------------------------------------------------------------


def test_a_seeded_request_gets_the_same_tokens_whatever_else_is_in_the_batch():
    seeded = SamplingParams(temperature=1.0, seed=7, max_tokens=100)
    drafts = [3, 0, 2]

    def run(companions: int) -> list[int]:
        requests = [req(drafts, seeded, generator=seeded_generator(7, "cpu"))]
        requests += [req([1, 1, 1], SamplingParams(temperature=1.0, max_tokens=100)) for _ in range(companions)]
        probs = WRONG_DRAFTER.repeat(len(requests), 1)
        return rejection_sample(TARGET.repeat(len(requests), 1), requests, probs).token_lists()[0]

    first = run(0)
    assert all(run(c) == first for c in (1, 5, 2))


def test_logprobs_of_emitted_tokens_are_the_target_raw_logprobs_at_their_rows():
    params = SamplingParams(temperature=0.0, logprobs=2, max_tokens=100)
    out = rejection_sample(TARGET, [req([0, 1, 5], params)])
    raw = TARGET.log_softmax(-1)
    tokens = out.token_lists()[0]
    assert out.emitted_rows.tolist() == list(range(len(tokens)))
    for j, t in enumerate(tokens):
        assert torch.allclose(out.logprobs[j], raw[j, t])
        assert out.ranks[j] == 1 + int((raw[j] > raw[j, t]).sum())
        assert out.top_token_ids[j].tolist() == raw[j].topk(2).indices.tolist()


def test_synthetic_acceptance_follows_the_configured_curve():
    rates = [0.8, 0.6, 0.3]
    torch.manual_seed(0)
    n = 6000
    requests = [req([0, 0, 0]) for _ in range(n)]
    out = rejection_sample(peaked([1, 1, 1, 1]).repeat(n, 1), requests, synthetic_rates=rates)
    m = out.num_accepted
    for j, r in enumerate(rates):
        assert abs(float((m > j).float().mean()) - r) < 0.03
    assert all(t[-1] == 1 for t in out.token_lists())  # the token after them is the target's


def _mixed_greedy_batch(params, seed=0):
    """Random target rows and drafts that match the argmax chain for a random number of positions."""
    g = torch.Generator().manual_seed(seed)
    requests, logits = [], []
    for i in range(12):
        n = i % 4
        rows = torch.randn(n + 1, V, generator=g)
        chain = rows.argmax(-1).tolist()
        cut = int(torch.randint(0, n + 1, (1,), generator=g))
        drafts = chain[:cut] + [(t + 1) % V for t in chain[cut:n]]
        requests.append(req(drafts, params))
        logits.append(rows)
    return torch.cat(logits), requests


def test_greedy_steps_without_logprobs_decide_what_the_general_path_decides():
    plain = SamplingParams(temperature=0.0, max_tokens=100)
    logged = SamplingParams(temperature=0.0, max_tokens=100, logprobs=1)  # takes the general path
    logits, fast_reqs = _mixed_greedy_batch(plain)
    _, slow_reqs = _mixed_greedy_batch(logged)
    fast, slow = rejection_sample(logits, fast_reqs), rejection_sample(logits, slow_reqs)
    assert fast.token_lists() == slow.token_lists()
    assert fast.num_accepted.tolist() == slow.num_accepted.tolist()
    assert fast.emitted_rows.tolist() == slow.emitted_rows.tolist()
    assert fast.output_token_ids.tolist() == slow.output_token_ids.tolist()
    assert 0 < sum(fast.num_accepted.tolist()) < sum(len(r.draft_token_ids) for r in fast_reqs)


def test_synthetic_greedy_steps_without_logprobs_decide_what_the_general_path_decides():
    rates = [0.9, 0.5, 0.2]
    logits, fast_reqs = _mixed_greedy_batch(SamplingParams(temperature=0.0, max_tokens=100))
    _, slow_reqs = _mixed_greedy_batch(SamplingParams(temperature=0.0, max_tokens=100, logprobs=1))
    torch.manual_seed(3)
    fast = rejection_sample(logits, fast_reqs, synthetic_rates=rates)
    torch.manual_seed(3)
    slow = rejection_sample(logits, slow_reqs, synthetic_rates=rates)
    assert fast.token_lists() == slow.token_lists()
    assert fast.num_accepted.tolist() == slow.num_accepted.tolist()
