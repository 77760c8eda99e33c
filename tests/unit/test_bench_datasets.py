"""pdserve bench's prompts: exact token lengths from the real default tokenizer."""

from __future__ import annotations

import json

import pytest

from engine.loader.locate import default_model_path
from engine.tokenizer import load_tokenizer
from pdserve.bench.datasets import length_bounds, prefix_requests, random_requests
from pdserve.bench.datasets_files import jsonl_requests, sharegpt_requests


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(default_model_path())


def _count(tokenizer, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


def test_length_bounds_follow_vllms_floor_and_ceil():
    assert length_bounds(100, 0.25) == (75, 125)
    assert length_bounds(7, 0.5) == (3, 11)
    assert length_bounds(1, 0.9, minimum=1) == (1, 2)
    assert length_bounds(16, 0.0) == (16, 16)


def test_random_prompts_have_exactly_the_requested_token_count(tokenizer):
    requests = random_requests(tokenizer, 24, input_len=64, output_len=16, seed=0)
    assert [r.prompt_len for r in requests] == [64] * 24
    assert [_count(tokenizer, r.prompt) for r in requests] == [64] * 24
    assert [r.expected_output_len for r in requests] == [16] * 24
    assert len({r.prompt for r in requests}) == 24


def test_random_lengths_stay_within_the_range_ratio_interval(tokenizer):
    requests = random_requests(tokenizer, 40, input_len=100, output_len=20, range_ratio=0.5, seed=1)
    inputs = [r.prompt_len for r in requests]
    outputs = [r.expected_output_len for r in requests]
    assert all(50 <= n <= 150 for n in inputs) and all(10 <= n <= 30 for n in outputs)
    assert len(set(inputs)) > 10 and len(set(outputs)) > 5  # really spread, not one value
    assert inputs == [_count(tokenizer, r.prompt) for r in requests]


def test_random_prefix_is_shared_and_counted_in_the_length(tokenizer):
    requests = random_requests(tokenizer, 5, input_len=32, output_len=4, prefix_len=16, seed=2)
    assert [r.prompt_len for r in requests] == [48] * 5
    first = tokenizer.encode(requests[0].prompt, add_special_tokens=False)[:12]
    assert all(tokenizer.encode(r.prompt, add_special_tokens=False)[:12] == first for r in requests)


def test_random_dataset_is_reproducible_for_a_seed(tokenizer):
    assert random_requests(tokenizer, 3, 32, 8, seed=5) == random_requests(tokenizer, 3, 32, 8, seed=5)
    assert random_requests(tokenizer, 3, 32, 8, seed=5) != random_requests(tokenizer, 3, 32, 8, seed=6)


def test_prefix_dataset_shares_each_prefix_among_its_requests(tokenizer):
    requests = prefix_requests(tokenizer, 6, prefix_len=32, suffix_len=16, num_prefixes=2, output_len=8, seed=0)
    assert len(requests) == 6 and {r.expected_output_len for r in requests} == {8}
    heads = sorted(r.prompt[:40] for r in requests)
    assert len(set(heads)) == 2 and heads.count(heads[0]) == 3
    assert all(47 <= r.prompt_len <= 49 for r in requests)  # 32 + 16, give or take a merge at the seam


def test_range_ratio_of_one_or_more_is_refused(tokenizer):
    with pytest.raises(ValueError, match="range-ratio"):
        random_requests(tokenizer, 2, 32, 8, range_ratio=1.0)


def test_sharegpt_file_gives_first_turn_prompts_and_answer_lengths(tokenizer, tmp_path):
    path = tmp_path / "sg.json"
    path.write_text(json.dumps([
        {"conversations": [{"from": "human", "value": "What is the capital of France, please?"},
                           {"from": "gpt", "value": "The capital of France is Paris, a large city."}]},
        {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello there, friend!"}]},
    ]))
    requests = sharegpt_requests(tokenizer, path, 3, seed=0)
    answer_len = _count(tokenizer, "The capital of France is Paris, a large city.")
    assert [r.prompt for r in requests] == ["What is the capital of France, please?"] * 3  # "Hi" is too short
    assert [r.expected_output_len for r in requests] == [answer_len] * 3


def test_jsonl_file_takes_prompts_in_order_with_their_output_lengths(tokenizer, tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "one two three"}\n\n{"prompt": "four", "output_len": 5}\n')
    requests = jsonl_requests(tokenizer, path, 3, output_len=7)
    assert [(r.prompt, r.expected_output_len) for r in requests] == [
        ("one two three", 7), ("four", 5), ("one two three", 7)]
    assert requests[0].prompt_len == _count(tokenizer, "one two three")
