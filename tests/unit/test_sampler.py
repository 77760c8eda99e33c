import math

import pytest
import torch

from engine.sampler import Sampler, SamplingRow, TokenLogprobs, _apply_penalties
from engine.sampling_params import SamplingParams

EOS = 9

# Probabilities 0.5, 0.3, 0.15, 0.05 for tokens 0..3 (everything else impossible).
SKEWED = [math.log(0.5), math.log(0.3), math.log(0.15), math.log(0.05)] + [float("-inf")] * 6


def row(params=None, prompt=(), output=(), stop=frozenset({EOS}), seed=None):
    generator = None
    if seed is not None:
        generator = torch.Generator().manual_seed(seed)
    return SamplingRow(
        params=params or SamplingParams.greedy(),
        prompt_token_ids=list(prompt),
        output_token_ids=list(output),
        stop_token_ids=stop,
        generator=generator,
    )


def logits_of(*rows_values):
    return torch.tensor(rows_values, dtype=torch.float32)


def sample_many(logits_row, params, times=200, seed=0):
    sampler = Sampler()
    r = row(params, seed=seed)
    return [sampler(logits_of(logits_row), [r]).token_ids[0] for _ in range(times)]


def test_greedy_batch_picks_each_rows_argmax():
    logits = logits_of(
        [0.1, 0.2, 3.0, 0.0, -1.0, 0.5, 0.0, 0.0, 0.0, 0.0],
        [5.0, 0.2, 3.0, 0.0, -1.0, 0.5, 0.0, 0.0, 0.0, 0.0],
        [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 7.5],
    )
    out = Sampler()(logits, [row(), row(), row()])
    assert out.token_ids == [2, 0, 9]
    assert out.logprobs == [None, None, None]


def test_greedy_ties_pick_the_first_maximum():
    logits = logits_of([0.0, 2.0, 1.0, 2.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    assert Sampler()(logits, [row()]).token_ids == [1]


def test_greedy_fast_path_takes_bfloat16_rows_and_nan_as_torch_argmax_does():
    logits = logits_of([0.0, 3.0, 3.0, 1.0], [0.0, float("nan"), 9.0, float("nan")], [1.0, 0.0, 0.0, 0.0]).bfloat16()
    assert Sampler()(logits, [row(), row(), row()]).token_ids == logits.argmax(-1).tolist() == [1, 1, 0]


def test_greedy_accepts_bfloat16_logits():
    logits = logits_of([0.0, 1.0, 4.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]).bfloat16()
    assert Sampler()(logits, [row(SamplingParams.greedy(logprobs=1))]).token_ids == [2]


def test_penalties_match_hand_computation():
    logits = logits_of([2.0, -1.0, 0.5, 3.0, 0.0, 1.0])
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    _apply_penalties(logits, [row(params, prompt=[0, 1], output=[3, 3, 2])], [0])
    # 0: prompt, positive -> 2/2.  1: prompt, negative -> -1*2.
    # 2: output once -> 0.5/2 - 0.5*1 - 0.25.  3: output twice -> 3/2 - 0.5*2 - 0.25.
    # 4, 5: unseen, unchanged.
    assert logits.tolist() == [[1.0, -2.0, -0.5, 0.25, 0.0, 1.0]]


def test_penalties_apply_only_to_their_own_row():
    logits = logits_of([2.0, 1.0, 0.0], [2.0, 1.0, 0.0])
    params = SamplingParams(presence_penalty=2.0)
    rows = [row(output=[0]), row(params, output=[0])]
    _apply_penalties(logits, rows, [1])
    assert logits.tolist() == [[2.0, 1.0, 0.0], [0.0, 1.0, 0.0]]


def test_presence_penalty_changes_the_greedy_choice():
    logits = logits_of([0.0, 2.0, 1.5, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    plain = row(SamplingParams.greedy(), output=[1])
    penalized = row(SamplingParams.greedy(presence_penalty=1.0), output=[1])
    assert Sampler()(logits.repeat(2, 1), [plain, penalized]).token_ids == [1, 2]


def test_repetition_penalty_counts_prompt_tokens():
    logits = logits_of([0.0, 2.0, 1.5, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    r = row(SamplingParams.greedy(repetition_penalty=1.5), prompt=[1])
    assert Sampler()(logits, [r]).token_ids == [2]


def test_sampler_leaves_callers_logits_unchanged():
    logits = logits_of([0.0, 2.0, 1.5, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, EOS])
    before = logits.clone()
    rows = [row(SamplingParams.greedy(repetition_penalty=1.5, min_tokens=3), prompt=[1])]
    Sampler()(logits, rows)
    assert torch.equal(logits, before)


def test_min_tokens_masks_stop_tokens_until_reached():
    logits = logits_of([0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 5.0]).repeat(2, 1)
    params = SamplingParams.greedy(min_tokens=2)
    rows = [row(params, output=[4]), row(params, output=[4, 4])]
    assert Sampler()(logits, rows).token_ids == [1, EOS]


def test_min_tokens_masks_every_stop_token_id_of_the_row():
    logits = logits_of([0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 4.0, 5.0])
    r = row(SamplingParams.greedy(min_tokens=1), stop=frozenset({8, EOS}))
    assert Sampler()(logits, [r]).token_ids == [1]


def test_min_tokens_ignores_stop_ids_outside_the_vocab():
    logits = logits_of([0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 5.0])
    r = row(SamplingParams.greedy(min_tokens=1), stop=frozenset({EOS, 50000}))
    assert Sampler()(logits, [r]).token_ids == [1]


def test_top_k_one_always_samples_the_argmax():
    samples = sample_many(SKEWED, SamplingParams(temperature=1.0, top_k=1), times=50)
    assert set(samples) == {0}


def test_top_k_two_samples_only_the_two_most_likely():
    samples = sample_many(SKEWED, SamplingParams(top_k=2))
    assert set(samples) == {0, 1}


def test_top_p_excludes_the_unlikely_tail():
    # Ascending cumulative mass 0.05, 0.2, 0.5, 1.0: with top_p=0.7 the first two (<= 0.3) go.
    samples = sample_many(SKEWED, SamplingParams(top_p=0.7))
    assert set(samples) == {0, 1}


def test_top_p_always_keeps_the_most_likely_token():
    samples = sample_many(SKEWED, SamplingParams(top_p=0.01), times=50)
    assert set(samples) == {0}


def test_min_p_excludes_tokens_below_fraction_of_the_top_probability():
    # Threshold 0.35 * 0.5 = 0.175: tokens with 0.15 and 0.05 go.
    samples = sample_many(SKEWED, SamplingParams(min_p=0.35))
    assert set(samples) == {0, 1}


def test_unfiltered_sampling_reaches_every_possible_token():
    samples = sample_many(SKEWED, SamplingParams(), times=400)
    assert set(samples) == {0, 1, 2, 3}


def test_random_rows_never_sample_min_tokens_masked_stop_token():
    logits = [0.0] * 9 + [10.0]
    params = SamplingParams(min_tokens=1)
    assert EOS not in sample_many(logits, params, times=50)


def test_greedy_and_random_rows_share_a_batch():
    logits = logits_of(SKEWED, SKEWED, SKEWED)
    rows = [
        row(),
        row(SamplingParams(top_k=1), seed=3),
        row(SamplingParams(temperature=0.5), seed=4),
    ]
    out = Sampler()(logits, rows)
    assert out.token_ids[:2] == [0, 0]
    assert out.token_ids[2] in {0, 1, 2, 3}


def _seeded_sequence(seed, companions, position, steps=8):
    """Samples of a seeded row over ``steps`` steps, batched at ``position`` among companions."""
    sampler = Sampler()
    uniform = torch.zeros(len(companions) + 1, 10)
    seeded = row(SamplingParams(seed=seed), seed=seed)
    rows = list(companions)
    rows.insert(position, seeded)
    return [sampler(uniform, rows).token_ids[position] for _ in range(steps)]


def test_same_seed_gives_same_samples_whatever_the_batch():
    alone = _seeded_sequence(7, [], 0)
    others = [row(SamplingParams()), row(SamplingParams(seed=9), seed=9), row()]
    assert _seeded_sequence(7, others, 0) == alone
    assert _seeded_sequence(7, others, 2) == alone
    assert _seeded_sequence(7, others[::-1], 3) == alone


def test_different_seeds_give_different_samples():
    assert _seeded_sequence(1, [], 0) != _seeded_sequence(2, [], 0)


def _log_softmax(values):
    top = max(values)
    log_total = top + math.log(sum(math.exp(v - top) for v in values))
    return [v - log_total for v in values]


def test_logprobs_of_greedy_token_are_raw_log_softmax_with_top_k():
    values = [0.5, 2.0, -1.0, 3.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    expected = _log_softmax(values)
    out = Sampler()(logits_of(values), [row(SamplingParams.greedy(logprobs=3))])
    lp = out.logprobs[0]
    assert isinstance(lp, TokenLogprobs)
    assert (lp.token_id, lp.rank) == (3, 1)
    assert lp.logprob == pytest.approx(expected[3], abs=1e-6)
    assert [t for t, _ in lp.top] == [3, 1, 5]
    top_values = [v for _, v in lp.top]
    assert top_values == pytest.approx([expected[3], expected[1], expected[5]], abs=1e-6)


def test_logprobs_are_taken_before_penalties_and_rank_the_raw_distribution():
    values = [0.5, 2.0, -1.0, 3.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    expected = _log_softmax(values)
    # The penalty turns the greedy pick from token 3 to token 1, the raw second choice.
    params = SamplingParams.greedy(logprobs=0, presence_penalty=2.0)
    lp = Sampler()(logits_of(values), [row(params, output=[3])]).logprobs[0]
    assert (lp.token_id, lp.rank, lp.top) == (1, 2, ())
    assert lp.logprob == pytest.approx(expected[1], abs=1e-6)


def test_logprobs_only_for_rows_that_ask():
    values = [0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    rows = [row(), row(SamplingParams.greedy(logprobs=1)), row()]
    out = Sampler()(logits_of(values, values, values), rows)
    assert out.logprobs[0] is None and out.logprobs[2] is None
    assert out.logprobs[1].token_id == 1
    assert [t for t, _ in out.logprobs[1].top] == [1]


def test_logprobs_of_a_random_sample_report_the_sampled_token():
    out = Sampler()(logits_of(SKEWED), [row(SamplingParams(top_k=1, logprobs=2), seed=0)])
    lp = out.logprobs[0]
    assert (lp.token_id, lp.rank, [t for t, _ in lp.top]) == (0, 1, [0, 1])
    assert lp.logprob == pytest.approx(math.log(0.5), abs=1e-6)


def test_mismatched_row_count_is_rejected():
    with pytest.raises(ValueError, match=r"num_rows=2, got shape \(1, 10\)"):
        Sampler()(torch.zeros(1, 10), [row(), row()])
