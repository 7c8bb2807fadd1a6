"""Confidence-scheduled verification (hyserve/spec_decode/confidence.py): which drafts get verified,
and why the admission of draft j must not look at x_j.

The counterexample (DSpark Appendix A's point, with numbers of our own: the paper's own figures were
not available here): the target says A with 0.7 and B with 0.3; the drafter proposes A or B with 0.5
each. A retrospective scheduler predicts each drafted token's acceptance from the token itself
(min(1, p/q): 1.0 for A, 0.6 for B) and verifies only what clears 0.8, i.e. only A. When it skips a
draft the step emits the target's own sample. Its output is A with 0.5 + 0.5 x 0.7 = 0.85 (0.849 in a
sampled run) instead of 0.70. The causal confidence (predicted before x is drawn) is the same for
both draws, so the scheduler's choice cannot bias the token, and the output is A with 0.70.
"""

from __future__ import annotations

import torch

from hyserve.sampling_params import SamplingParams
from hyserve.spec_decode.confidence import best_capacity, threshold_lengths, top_capacity_lengths
from hyserve.spec_decode.rejection import rejection_sample
from hyserve.spec_decode.target_probs import SpecRequest

P_TARGET = torch.tensor([0.7, 0.3])
Q_DRAFT = torch.tensor([0.5, 0.5])
THRESHOLD = 0.8
TRIALS = 30000


def retrospective_confidence(x: torch.Tensor) -> torch.Tensor:
    """Acceptance predicted from the drafted token itself: min(1, p(x)/q(x)) (1.0 for A, 0.6 for B)."""
    return torch.clamp(P_TARGET[x] / Q_DRAFT[x], max=1.0)


def causal_confidence(x: torch.Tensor) -> torch.Tensor:
    """Acceptance predicted before x is drawn: sum_v min(p, q) = 0.8 whatever x turns out to be."""
    return torch.full(x.shape, float(torch.minimum(P_TARGET, Q_DRAFT).sum()))


def step_outputs(confidence_of) -> torch.Tensor:
    """One verify step for TRIALS requests of one draft each: the scheduler picks how many of the draft
    to verify (0 or 1), the rejection sampler does the rest. Returns each request's first token."""
    torch.manual_seed(0)
    drafts = torch.multinomial(Q_DRAFT, TRIALS, replacement=True)
    verify = threshold_lengths(confidence_of(drafts).unsqueeze(1), THRESHOLD).tolist()
    params = SamplingParams(temperature=1.0, max_tokens=10)
    requests = [SpecRequest(params, [], [0], None, [int(x)] if n else []) for x, n in zip(drafts, verify)]
    rows = [1 + n for n in verify]
    logits = P_TARGET.log().repeat(sum(rows), 1)
    probs = Q_DRAFT.repeat(sum(verify), 1)
    return rejection_sample(logits, requests, probs).output_token_ids[:, 0]


def exact_probability_of_a(confidence_of) -> float:
    """The same step in closed form: sum over the draft x of q(x) x P(first token A | x)."""
    total = 0.0
    for x in (0, 1):
        verified = float(confidence_of(torch.tensor([x]))[0]) >= THRESHOLD
        if not verified:
            p_a = float(P_TARGET[0])
        elif x == 0:
            p_a = min(1.0, float(P_TARGET[0] / Q_DRAFT[0]))  # accepted A; the residual of a rejection is B
        else:
            accept = min(1.0, float(P_TARGET[1] / Q_DRAFT[1]))
            p_a = 1.0 - accept  # accepted B, or the residual max(0, p - q) = (0.2, 0): A
        total += float(Q_DRAFT[x]) * p_a
    return total


def test_the_retrospective_rule_changes_the_output_distribution():
    assert abs(exact_probability_of_a(retrospective_confidence) - 0.85) < 1e-6
    sampled = float((step_outputs(retrospective_confidence) == 0).float().mean())
    assert abs(sampled - 0.85) < 0.01  # 5 standard errors


def test_the_causal_rule_keeps_the_target_distribution():
    assert abs(exact_probability_of_a(causal_confidence) - 0.70) < 1e-6
    sampled = float((step_outputs(causal_confidence) == 0).float().mean())
    assert abs(sampled - 0.70) < 0.01


def test_threshold_verifies_the_prefix_whose_survival_clears_it():
    conf = torch.tensor([[0.9, 0.9, 0.9, 0.9], [0.5, 1.0, 1.0, 1.0], [0.95, 0.2, 0.99, 0.99]])
    # survivals: 0.9 0.81 0.729 0.656 | 0.5 ... | 0.95 0.19 ...
    assert threshold_lengths(conf, 0.7).tolist() == [3, 0, 1]
    assert threshold_lengths(conf, 0.7, num_drafts=[2, 4, 4]).tolist() == [2, 0, 1]
    assert threshold_lengths(conf, 0.0).tolist() == [4, 4, 4]


def test_capacity_admits_the_highest_survivals_across_requests_in_draft_order():
    conf = torch.tensor([[0.9, 0.9, 0.9], [0.99, 0.5, 0.5], [0.6, 1.0, 1.0]])
    # survivals: 0.9 0.81 0.729 | 0.99 0.495 0.2475 | 0.6 0.6 0.6
    assert top_capacity_lengths(conf, 4).tolist() == [3, 1, 0]
    assert top_capacity_lengths(conf, 6).tolist() == [3, 1, 2]  # ties at 0.6: earlier position first
    assert top_capacity_lengths(conf, 0).tolist() == [0, 0, 0]


def test_best_capacity_stops_where_another_position_costs_more_than_it_brings():
    conf = torch.tensor([[0.9, 0.9, 0.9, 0.1], [0.8, 0.8, 0.1, 0.1]])
    free = best_capacity(conf, lambda n: 100.0)  # verify positions cost nothing: take all useful ones
    assert free == 8
    # a step of n positions runs 100 / (1 + 0.1 n) times a second: survivals 0.9 0.81 0.8 0.729 0.64 pay
    # for their position (tokens x rate 1.67 -> 2.23 -> 2.65 -> 3.01 -> 3.27 -> 3.46), 0.0729 does not (3.31)
    assert best_capacity(conf, lambda n: 100.0 / (1 + 0.1 * n)) == 5
    assert best_capacity(conf, lambda n: 100.0 / n) == 0
