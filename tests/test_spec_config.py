"""`--speculative-config` parsing (hyserve/spec_decode/config.py): vLLM's keys and defaults, clear
errors for unknown keys and bad values."""

from __future__ import annotations

import pytest

from hyserve.spec_decode.config import SpeculativeConfig, parse_speculative_config, rates_for_length


def test_ngram_json_parses_with_vllm_keys():
    cfg = parse_speculative_config(
        '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}')
    assert (cfg.method, cfg.num_speculative_tokens, cfg.prompt_lookup_min, cfg.prompt_lookup_max) == ("ngram", 4, 2, 5)
    assert cfg.draft_sample_method == "greedy" and cfg.rejection_sample_method == "standard"


def test_ngram_lookup_bounds_default_like_vllm():
    assert parse_speculative_config({"method": "ngram", "num_speculative_tokens": 3}).prompt_lookup_min == 5
    one = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2})
    assert (one.prompt_lookup_min, one.prompt_lookup_max) == (2, 2)
    other = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 4})
    assert (other.prompt_lookup_min, other.prompt_lookup_max) == (4, 4)


def test_dspark_takes_the_drafter_directory_and_may_leave_the_count_to_it():
    cfg = parse_speculative_config(
        '{"method": "dspark", "model": "/m/drafter", "draft_sample_method": "probabilistic", '
        '"confidence_threshold": 0.3}')
    assert cfg.model == "/m/drafter" and cfg.num_speculative_tokens is None and cfg.confidence_threshold == 0.3


def test_ngram_drafts_are_budgeted_by_default_and_zero_verifies_every_draft():
    assert parse_speculative_config({"method": "ngram", "num_speculative_tokens": 3}).confidence_threshold == 0.3
    assert parse_speculative_config({"method": "ngram", "num_speculative_tokens": 3,
                                     "confidence_threshold": 0}).confidence_threshold == 0
    synthetic = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 3,
                                          "rejection_sample_method": "synthetic", "synthetic_acceptance_length": 2})
    assert synthetic.confidence_threshold is None  # its curve verifies every draft


def test_none_means_no_speculation():
    assert parse_speculative_config(None) is None


def test_synthetic_length_becomes_the_least_variance_curve():
    cfg = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 4,
                                    "rejection_sample_method": "synthetic", "synthetic_acceptance_length": 3.36})
    assert cfg.synthetic_acceptance_rates == pytest.approx([1.0, 1.0, 0.36, 0.0])
    assert rates_for_length(5.0, 4) == [1.0, 1.0, 1.0, 1.0]
    assert rates_for_length(1.0, 3) == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("value, message", [
    ('{"method": "ngram", "num_speculative_tokens": 4, "lookup": 3}', "unknown speculative config key(s) 'lookup'"),
    ('{"num_speculative_tokens": 4}', "needs 'method'"),
    ('{"method": "eagle", "num_speculative_tokens": 4}', "must be one of ngram, dspark"),
    ('{"method": "ngram"}', "needs num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "must be in [1, 128]"),
    ('{"method": "ngram", "num_speculative_tokens": "4"}', "'num_speculative_tokens' must be an integer"),
    ('{"method": "ngram", "num_speculative_tokens": true}', "must be an integer"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}',
     "must not exceed"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}', ">= 1"),
    ('{"method": "dspark"}', "needs 'model'"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "draft_sample_method": "top"}', "draft_sample_method"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "rejection_sample_method": "synthetic", '
     '"synthetic_acceptance_length": 2, "confidence_threshold": 0.5}', "judges no draft"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "confidence_threshold": -0.1}', "in [0, 1]"),
    ('{"method": "dspark", "model": "d", "confidence_threshold": 1.5}', "in [0, 1]"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "rejection_sample_method": "synthetic"}', "exactly one"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "rejection_sample_method": "synthetic", '
     '"synthetic_acceptance_rates": [0.5, 0.7]}', "non-increasing"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "rejection_sample_method": "synthetic", '
     '"synthetic_acceptance_rates": [0.5]}', "must have 2 entries"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "rejection_sample_method": "synthetic", '
     '"synthetic_acceptance_length": 3.5}', "in [1, 3]"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "synthetic_acceptance_length": 2}', "need rejection_sample"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "rejection_sample_method": "synthetic", '
     '"synthetic_acceptance_rates": ["a", 0.1]}', "a list of numbers"),
    ('{"method": ', "not valid JSON"),
    ('[1, 2]', "must be a JSON object"),
])
def test_bad_config_is_a_clear_error(value, message):
    with pytest.raises(ValueError) as e:
        parse_speculative_config(value)
    assert message in str(e.value)


def test_the_dataclass_checks_when_built_directly():
    with pytest.raises(ValueError, match="needs num_speculative_tokens"):
        SpeculativeConfig(method="ngram")
