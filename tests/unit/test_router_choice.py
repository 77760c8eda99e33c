"""ChoiceTracker: token deltas -> text, with stop strings and stop tokens handled as vLLM does."""

from __future__ import annotations

from engine.sampling_params import SamplingParams
from router.serving.backend import TokenDelta
from router.serving.choice import ChoiceTracker
from router.serving.results import Choice, ChoiceUpdate, Logprob, PositionLogprobs
from router.serving.types import TokenLogprobs
from tests.unit.router_doubles import smollm2_tokenizer

PROMPT = (19556,)  # "Hello"
PARIS = (7042, 314, 9239, 30, 378, 1112)  # " Paris", " is", " nice", ".", " The", " end"
IM_END = 2


def tracker(**params) -> ChoiceTracker:
    return ChoiceTracker(0, smollm2_tokenizer(), PROMPT, SamplingParams(**params))


def feed(t: ChoiceTracker, *deltas: TokenDelta) -> list[ChoiceUpdate]:
    return [t.apply(d) for d in deltas]


def test_tokens_stream_as_text_until_length():
    t = tracker()
    updates = feed(t, TokenDelta((7042,)), TokenDelta((314, 9239), finish_reason="length"))
    assert [(u.text, u.token_ids, u.finish_reason) for u in updates] == [
        (" Paris", (7042,), None),
        (" is nice", (314, 9239), "length"),
    ]
    assert t.result() == Choice(0, " Paris is nice", (7042, 314, 9239), None, "length", None)


def test_stop_string_split_over_tokens_cuts_the_text_and_drops_later_tokens():
    t = tracker(stop=["nice."])
    updates = feed(t, TokenDelta((7042, 314)), TokenDelta((9239,)), TokenDelta((30, 378, 1112)))
    # " nice" is held back until "." settles it; " The end" after the match is never consumed.
    assert [(u.text, u.token_ids, u.finish_reason, u.stop_reason) for u in updates] == [
        (" Paris is", (7042, 314), None, None),
        (" ", (9239,), None, None),
        ("", (30,), "stop", "nice."),
    ]
    assert t.stopped_by_string is True
    assert t.result().text == " Paris is "
    assert t.num_tokens == 4


def test_stop_string_kept_with_include_stop_str_in_output():
    t = tracker(stop=["nice"], include_stop_str_in_output=True)
    feed(t, TokenDelta(PARIS))
    assert (t.result().text, t.stop_reason) == (" Paris is nice", "nice")


def test_eos_token_is_counted_but_not_in_the_text():
    t = tracker()
    feed(t, TokenDelta((7042, IM_END), finish_reason="stop", stop_token_id=IM_END))
    assert t.result() == Choice(0, " Paris", (7042, IM_END), None, "stop", None)


def test_a_users_stop_token_is_the_stop_reason():
    t = tracker(stop_token_ids=[30])
    feed(t, TokenDelta((7042, 30), finish_reason="stop", stop_token_id=30))
    assert (t.result().text, t.finish_reason, t.stop_reason) == (" Paris", "stop", 30)


def test_text_held_back_for_a_possible_stop_string_is_released_at_the_end():
    t = tracker(stop=[" isn't"])
    updates = feed(t, TokenDelta((7042, 314), finish_reason="length"))
    assert updates[0].text == " Paris is"


def test_a_character_split_over_tokens_comes_out_whole():
    t = tracker()
    last = TokenDelta((239,), finish_reason="length")
    updates = feed(t, TokenDelta((4636,)), TokenDelta((242,)), last)
    assert [u.text for u in updates] == ["", "", " ☕"]


def test_logprobs_are_decoded_and_cut_to_the_requested_top_k():
    t = tracker(logprobs=1)
    lp = TokenLogprobs(7042, -0.5, 1, top=((7042, -0.5), (4649, -1.5)))
    (update,) = feed(t, TokenDelta((7042,), logprobs=(lp,), finish_reason="length"))
    assert update.logprobs == (
        PositionLogprobs(
            sampled=Logprob(7042, " Paris", -0.5), top=(Logprob(7042, " Paris", -0.5),)
        ),
    )


def test_echo_prefixes_the_first_update_with_the_prompt_text():
    t = ChoiceTracker(0, smollm2_tokenizer(), PROMPT, SamplingParams(), echo_text="Hello")
    updates = feed(t, TokenDelta((7042,)), TokenDelta((314,), finish_reason="length"))
    assert [u.text for u in updates] == ["Hello Paris", " is"]
