"""The draft budget (hyserve/spec_decode/draft_budget.py): each n-gram request verifies the drafts its measured
acceptance predicts will survive, a step verifies drafts only when they pay for the step (a DSpark verify step
with the drafter's forward), and a request that was turned down keeps being judged on the tokens it would have
drafted (or, without such trials, is tried again later)."""

from __future__ import annotations

import pytest

from hyserve.spec_decode.draft_budget import (
    IDLE_DECAY,
    STEP_OVERHEAD_S,
    DraftBudget,
    drafted_step_seconds,
    step_seconds,
)


def linear_cost(tokens: int, verify: bool) -> float:
    """A step costs 10 units plus one per token up to 64 (every expert read), a verify step one unit more:
    drafts are cheap at batch 1, and padding 32 rows to 2 tokens costs 32 units more."""
    return 10.0 + min(tokens, 64) + (1.0 if verify else 0.0)


def test_a_new_request_verifies_every_draft():
    budget = DraftBudget(0.3, linear_cost)
    assert budget.rate("a") == 1.0
    assert budget.lengths(["a"], [4], batch=1) == [4]


def test_rejections_shorten_the_verified_prefix_to_the_drafts_whose_survival_clears_the_threshold():
    budget = DraftBudget(0.3, linear_cost)
    budget.record("a", verified=4, accepted=0)  # rate (0 + 1) / (1 + 1) = 0.5: survivals 0.5, 0.25
    assert budget.rate("a") == pytest.approx(0.5)
    assert budget.lengths(["a"], [4], batch=1) == [1]
    budget.record("a", verified=1, accepted=0)  # rate 1 / 2.9
    assert budget.lengths(["a"], [4], batch=1) == [1]
    budget.record("a", verified=1, accepted=0)  # rate 1 / 3.71: its first draft's survival is under 0.3
    assert budget.lengths(["a"], [4], batch=1) == [0]


def test_accepted_drafts_keep_the_prefix_long():
    budget = DraftBudget(0.3, linear_cost)
    for _ in range(5):
        budget.record("a", verified=4, accepted=4)
    assert budget.rate("a") == 1.0
    budget.record("a", verified=4, accepted=3)  # 3 hits, then 1 miss
    assert 0.8 < budget.rate("a") < 1.0 and budget.lengths(["a"], [4], batch=1) == [4]


def test_a_proposal_shorter_than_the_prefix_is_kept_whole():
    assert DraftBudget(0.3, linear_cost).lengths(["a", "b"], [2, 0], batch=2) == [2, 0]


def test_drafts_that_do_not_pay_for_a_large_batch_are_all_dropped():
    """One request drafting pads all 32 rows to 2 tokens (32 units more): its expected 0.9 token does not pay
    for that, while at batch 1 it does (1 unit more)."""
    budget = DraftBudget(0.3, linear_cost)
    for _ in range(10):
        budget.record("a", verified=1, accepted=1)
    budget.record("a", verified=1, accepted=0)
    keys = ["a"] + [f"r{i}" for i in range(31)]
    assert budget.lengths(keys, [1] + [0] * 31, batch=32) == [0] * 32
    assert budget.lengths(["a"], [1], batch=1) == [1]


def test_a_large_batch_of_well_accepted_drafts_verifies():
    budget = DraftBudget(0.3, linear_cost)
    keys = [f"r{i}" for i in range(32)]
    for k in keys:
        for _ in range(4):
            budget.record(k, verified=4, accepted=3)
    assert budget.lengths(keys, [4] * 32, batch=32) == [4] * 32


def test_may_draft_is_false_once_no_full_proposal_could_pay():
    budget = DraftBudget(0.3, linear_cost)
    assert budget.may_draft(["a", "b"], 4, batch=2)
    for key in ("a", "b"):
        for _ in range(3):
            budget.record(key, verified=1, accepted=0)
    assert not budget.may_draft(["a", "b"], 4, batch=2)


def test_a_turned_down_request_is_tried_again_after_idle_steps():
    budget = DraftBudget(0.3, linear_cost)
    for _ in range(3):
        budget.record("a", verified=1, accepted=0)
    assert budget.lengths(["a"], [4], batch=1) == [0]
    steps = 0
    while budget.lengths(["a"], [4], batch=1) == [0]:
        budget.idle("a")
        steps += 1
    assert 10 < steps < 200  # neither at once nor never
    assert budget.rate("a") > 0.3


def test_idle_decays_only_known_requests_and_retain_forgets_the_rest():
    budget = DraftBudget(0.3, linear_cost)
    budget.idle("unknown")
    assert len(budget) == 0
    budget.record("a", verified=2, accepted=1)
    budget.record("b", verified=2, accepted=2)
    before = budget.rate("a")
    budget.idle("a")
    assert budget.rate("a") > before  # both counts shrink by IDLE_DECAY: the rate moves toward the prior
    assert IDLE_DECAY < 1.0
    budget.retain(["b"])
    assert len(budget) == 1 and budget.rate("a") == 1.0


def test_step_seconds_grow_with_the_bytes_the_tokens_read_and_a_verify_waits_longer():
    seconds = step_seconds(lambda tokens: 1e9 * tokens, 1e12)  # 1 ms a token at 1 TB/s
    assert seconds(2, False) - seconds(1, False) == pytest.approx(1e-3)
    assert seconds(1, True) > seconds(1, False)


def test_a_drafted_verify_step_adds_one_drafting_call_and_a_plain_step_does_not():
    def weight_bytes(tokens):
        return 1e9 * tokens

    target, drafted = step_seconds(weight_bytes, 1e12), drafted_step_seconds(weight_bytes, 1e12, drafter_bytes=2e9)
    assert drafted(5, True) - target(5, True) == pytest.approx(2e-3 + STEP_OVERHEAD_S)
    assert drafted(1, False) == target(1, False)


def test_a_threshold_of_zero_keeps_every_proposed_draft_and_only_the_pay_rule_cuts():
    budget = DraftBudget(0.0, linear_cost)
    budget.record("a", verified=4, accepted=0)  # rate 0.5: its prefix rule at 0.3 would keep 1 draft
    assert budget.lengths(["a"], [4], batch=1) == [4]
    assert budget.lengths(["a"] + [f"r{i}" for i in range(31)], [4] + [0] * 31, batch=32) == [0] * 32


def test_a_turned_down_draft_is_scored_once_the_token_at_its_position_is_known():
    budget = DraftBudget(0.3, linear_cost)
    budget.record("a", 4, 0)
    before = budget.rate("a")
    budget.expect("a", 5, 42)
    assert not budget.judge("a", [1, 2, 3, 4, 5])  # position 5 not emitted yet
    assert budget.judge("a", [1, 2, 3, 4, 5, 42])
    assert budget.rate("a") > before
    assert not budget.judge("a", [1, 2, 3, 4, 5, 42, 7])  # scored once


def test_a_turned_down_draft_that_would_have_missed_lowers_the_rate():
    budget = DraftBudget(0.3, linear_cost)
    budget.record("a", 4, 2)
    before = budget.rate("a")
    budget.expect("a", 3, 42)
    assert budget.judge("a", [1, 2, 3, 41])
    assert budget.rate("a") < before


def test_retain_forgets_the_turned_down_drafts_of_requests_that_left():
    budget = DraftBudget(0.3, linear_cost)
    budget.expect("a", 1, 42)
    budget.retain(["b"])
    assert not budget.judge("a", [1, 42])


def test_a_new_request_of_a_shadowed_budget_drafts_nothing_until_its_drafts_are_judged():
    budget = DraftBudget(0.3, linear_cost, shadowed=True)
    assert budget.lengths(["a"], [4], batch=1) == [0]
    assert not budget.may_draft(["a"], 4, batch=1)
    budget.expect("a", 3, 42)
    assert budget.judge("a", [1, 2, 3, 42])
    assert budget.lengths(["a"], [4], batch=1) == [4]
