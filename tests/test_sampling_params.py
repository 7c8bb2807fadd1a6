import pytest

from hyserve.sampling_params import MAX_LOGPROBS, SamplingParams, SamplingType


def test_defaults_are_neutral():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert p.max_tokens == 16 and p.min_tokens == 0
    assert p.stop == [] and p.stop_token_ids == []
    assert p.logprobs is None and p.prompt_logprobs is None
    assert p.skip_special_tokens and p.spaces_between_special_tokens and p.detokenize
    assert p.structured is None


def test_max_tokens_none_means_up_to_context_limit():
    assert SamplingParams(max_tokens=None).max_tokens is None


def test_stop_string_is_normalised_to_a_list():
    assert SamplingParams(stop="\n\n").stop == ["\n\n"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]


def test_top_k_minus_one_means_off():
    assert SamplingParams(top_k=-1).top_k == 0


def test_logit_bias_string_keys_become_token_ids():
    assert SamplingParams(logit_bias={"7": 2}).logit_bias == {7: 2.0}


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"n": 0}, "n"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"logprobs": MAX_LOGPROBS + 1}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"stop_token_ids": [-3]}, "stop_token_ids"),
        ({"logit_bias": {"x": 1.0}}, "logit_bias"),
    ],
)
def test_invalid_value_raises_value_error_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_error_message_shows_the_bad_value():
    with pytest.raises(ValueError, match="temperature must be non-negative, got -1"):
        SamplingParams(temperature=-1)


def test_logprobs_cap_is_inclusive():
    assert SamplingParams(logprobs=MAX_LOGPROBS).logprobs == MAX_LOGPROBS


def test_tiny_temperature_is_greedy():
    assert SamplingParams(temperature=0.0).is_greedy
    assert SamplingParams(temperature=1e-6).sampling_type == SamplingType.GREEDY
    assert not SamplingParams(temperature=0.7).is_greedy


def test_seed_makes_random_sampling_seeded():
    assert SamplingParams(seed=3).sampling_type == SamplingType.RANDOM_SEED
    assert SamplingParams().sampling_type == SamplingType.RANDOM


def test_greedy_turns_truncation_off():
    p = SamplingParams(temperature=0.0, top_k=5, top_p=0.5, min_p=0.2)
    assert (p.top_k, p.top_p, p.min_p) == (0, 1.0, 0.0)


def test_has_penalties_only_for_non_neutral_penalties():
    assert not SamplingParams().has_penalties
    assert SamplingParams(repetition_penalty=1.1).has_penalties
    assert SamplingParams(presence_penalty=0.5).has_penalties
