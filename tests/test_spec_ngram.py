"""N-gram prompt lookup (hyserve/spec_decode/ngram.py): vLLM's matching rules, checked on vLLM's own
cases and against a brute-force definition on random histories."""

from __future__ import annotations

import random

from hyserve.spec_decode.ngram import NgramProposer, TokenHistory


def propose(history, lo, hi, k=2, max_model_len=1000):
    return NgramProposer(lo, hi, k, max_model_len).propose([history])[0]


def brute_force(history, lo, hi, k, max_model_len):
    """The definition: the longest n in [lo, hi] whose suffix occurs earlier with a token after it;
    the earliest such occurrence; up to k following tokens within the history and the model length."""
    t = len(history)
    k = min(k, max_model_len - t)
    if k <= 0:
        return []
    for n in range(min(hi, t - 1), lo - 1, -1):
        suffix = history[t - n :]
        for p in range(0, t - n):
            if history[p : p + n] == suffix:
                return history[p + n : p + n + k]
    return []


def test_no_match_proposes_nothing():
    assert propose([1, 2, 3, 4, 5], 2, 2) == []


def test_a_shorter_match_counts_only_when_it_is_in_range():
    assert propose([1, 2, 3, 4, 1, 2, 3], 4, 4) == []
    assert propose([1, 2, 3, 4, 1, 2, 3], 3, 4) == [4, 1]


def test_the_longest_match_wins():
    assert propose([2, 3, 4, 5, 1, 2, 3, 4, 1, 2, 3, 4], 3, 4) == [1, 2]  # not the 3-gram's [5, 1]
    assert propose([3, 4, 5, 2, 3, 4, 1, 2, 3, 4], 2, 4) == [1, 2]


def test_the_earliest_occurrence_wins_among_equal_lengths():
    assert propose([1, 2, 3, 100, 1, 2, 3, 200, 1, 2, 3, 300, 1, 2, 3], 3, 3) == [100, 1]


def test_drafts_stop_at_the_end_of_the_history_and_the_model_length():
    assert propose([7, 8, 9, 7, 8], 2, 2, k=5) == [9, 7, 8]
    assert propose([7, 8, 9, 7, 8], 2, 2, k=5, max_model_len=7) == [9, 7]
    assert propose([7, 8, 9, 7, 8], 2, 2, k=5, max_model_len=5) == []


def test_overlapping_repeats_copy_the_run_forward():
    assert propose([1, 1, 1, 1], 2, 3, k=3) == [1]  # 3-gram [1 1 1] at 0, followed by one 1
    assert propose([5, 1, 1, 1, 1], 2, 2, k=3) == [1, 1]


def test_a_batch_of_mixed_lengths_is_matched_row_by_row():
    histories = [[], [4], [1, 2, 1], [9, 9, 9, 9, 9, 9], [3, 1, 2, 3, 1]]
    got = NgramProposer(1, 3, 3, 1000).propose(histories)
    assert got == [brute_force(h, 1, 3, 3, 1000) for h in histories]


def test_random_histories_match_the_definition():
    rng = random.Random(17)
    for _ in range(60):
        lo = rng.randrange(1, 5)
        hi = rng.randrange(lo, 7)
        k = rng.randrange(1, 6)
        histories = [[rng.randrange(4) for _ in range(rng.randrange(0, 60))] for _ in range(6)]
        max_len = max(len(h) for h in histories) + rng.randrange(0, 4)
        got = NgramProposer(lo, hi, k, max_len).propose(histories)
        assert got == [brute_force(h, lo, hi, k, max_len) for h in histories]


def test_a_kept_index_extended_step_by_step_proposes_what_a_fresh_match_proposes():
    rng = random.Random(5)
    for _ in range(20):
        lo = rng.randrange(1, 4)
        hi = rng.randrange(lo, 6)
        kept = NgramProposer(lo, hi, 3, 1000)
        history = [rng.randrange(3) for _ in range(rng.randrange(0, 8))]
        for _ in range(25):
            history += [rng.randrange(3) for _ in range(rng.randrange(1, 5))]  # accepted drafts + bonus
            assert kept.propose([history], keys=["r"]) == [brute_force(history, lo, hi, 3, 1000)]


def test_a_history_shorter_than_its_key_saw_is_indexed_again():
    proposer = NgramProposer(2, 2, 2, 1000)
    assert proposer.propose([[1, 2, 3, 1, 2]], keys=["r"]) == [[3, 1]]
    assert proposer.propose([[4, 5, 4, 5]], keys=["r"]) == [[4, 5]]  # a recomputed request: nothing of the old index


def test_token_history_reads_prompt_and_output_as_one_sequence():
    prompt, output = [7, 8, 9, 7], [8, 1, 7, 8]
    joined = prompt + output
    h = TokenHistory(prompt, output)
    assert len(h) == len(joined)
    for a in range(-3, 10):
        for b in range(-3, 10):
            assert h[a:b] == joined[a:b]
    assert NgramProposer(2, 3, 3, 1000).propose([h], keys=["r"]) == [brute_force(joined, 2, 3, 3, 1000)]


def test_retain_drops_the_indexes_of_other_requests():
    proposer = NgramProposer(1, 2, 2, 1000)
    proposer.propose([[1, 2, 1], [3, 3, 3]], keys=["a", "b"])
    proposer.retain(["b"])
    assert len(proposer) == 1
