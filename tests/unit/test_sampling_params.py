import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest

from engine.sampling_params import SamplingParams


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (1, 1.0, 1.0, 0, 0.0, None)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.stop, p.stop_token_ids) == ((), ())
    assert p.include_stop_str_in_output is False
    assert (p.ignore_eos, p.skip_special_tokens) == (False, True)
    assert (p.max_tokens, p.min_tokens, p.logprobs) == (16, 0, None)
    assert p.is_greedy is False


def test_stop_given_as_str_becomes_one_element_tuple():
    assert SamplingParams(stop="\n\n").stop == ("\n\n",)


def test_stop_and_stop_token_ids_given_as_lists_become_tuples():
    p = SamplingParams(stop=["a", "b"], stop_token_ids=[2, 7])
    assert p.stop == ("a", "b")
    assert p.stop_token_ids == (2, 7)


def test_stop_none_becomes_empty_tuple():
    assert SamplingParams(stop=None, stop_token_ids=None).stop == ()


def test_top_k_minus_one_is_normalized_to_zero():
    assert SamplingParams(top_k=-1).top_k == 0


def test_temperature_zero_is_greedy_and_resets_filters():
    p = SamplingParams(temperature=0.0, top_p=0.5, top_k=3, min_p=0.2)
    assert p.is_greedy is True
    assert (p.top_p, p.top_k, p.min_p) == (1.0, 0, 0.0)


def test_temperature_just_below_epsilon_is_greedy_and_at_epsilon_is_not():
    assert SamplingParams(temperature=9e-6).is_greedy is True
    assert SamplingParams(temperature=1e-5).is_greedy is False


def test_greedy_constructor_sets_temperature_zero_and_keeps_other_fields():
    p = SamplingParams.greedy(max_tokens=4, logprobs=2)
    assert (p.temperature, p.max_tokens, p.logprobs, p.is_greedy) == (0.0, 4, 2, True)


def test_params_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        SamplingParams().temperature = 0.5  # type: ignore[misc]


def test_min_tokens_equal_to_max_tokens_is_allowed():
    assert SamplingParams(min_tokens=8, max_tokens=8).min_tokens == 8


def test_max_tokens_none_allows_any_min_tokens():
    assert SamplingParams(max_tokens=None, min_tokens=1000).min_tokens == 1000


def test_logprobs_zero_and_twenty_are_allowed():
    assert SamplingParams(logprobs=0).logprobs == 0
    assert SamplingParams(logprobs=20).logprobs == 20


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"n": 0}, "n must be at least 1, got 0."),
        ({"temperature": -1.0}, "temperature must be non-negative, got -1.0."),
        ({"temperature": float("nan")}, "temperature must be non-negative, got nan."),
        ({"top_p": 0.0}, "top_p must be in (0, 1], got 0.0."),
        ({"top_p": 1.5}, "top_p must be in (0, 1], got 1.5."),
        ({"top_k": -2}, "top_k must be 0 (disable), or at least 1, got -2."),
        ({"min_p": 1.5}, "min_p must be in [0, 1], got 1.5."),
        ({"presence_penalty": 2.5}, "presence_penalty must be in [-2, 2], got 2.5."),
        ({"frequency_penalty": -3.0}, "frequency_penalty must be in [-2, 2], got -3.0."),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be greater than zero, got 0.0."),
        ({"max_tokens": 0}, "max_tokens must be at least 1, got 0."),
        ({"min_tokens": -1}, "min_tokens must be greater than or equal to 0, got -1."),
        (
            {"min_tokens": 5, "max_tokens": 4},
            "min_tokens must be less than or equal to max_tokens=4, got 5.",
        ),
        ({"logprobs": -1}, "logprobs must be non-negative, got -1."),
        (
            {"logprobs": 21},
            "Requested sample logprobs of 21, which is greater than max allowed: 20",
        ),
        ({"stop": ["ok", ""]}, "stop cannot contain an empty string."),
        ({"stop_token_ids": [1, "2"]}, "stop_token_ids must contain only integers, got [1, '2']."),
    ],
)
def test_invalid_values_are_rejected_with_vllm_messages(kwargs, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        SamplingParams(**kwargs)


def test_module_does_not_import_torch():
    code = "import sys, engine.sampling_params; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])
