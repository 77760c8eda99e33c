"""StopStringMatcher: vLLM's stop-string semantics over streamed text deltas."""

from __future__ import annotations

import pytest

from engine.tokenizer import StopStringMatcher
from engine.tokenizer.stop import StopCheck


def feed_all(matcher: StopStringMatcher, deltas: list[str]) -> list[StopCheck]:
    results = []
    for delta in deltas:
        results.append(matcher.feed(delta))
        if results[-1].matched is not None:
            break
    return results


def test_stop_string_split_across_deltas_is_caught_and_cut_off():
    matcher = StopStringMatcher(["STOP"], include_stop_str_in_output=False)
    assert feed_all(matcher, ["Hello ST", "OP and more"]) == [
        StopCheck(text="Hello ", matched=None),
        StopCheck(text="", matched="STOP"),
    ]
    assert matcher.finished


def test_stop_string_over_three_deltas_is_caught():
    matcher = StopStringMatcher(["STOP"])
    assert feed_all(matcher, ["xS", "TO", "Py"]) == [
        StopCheck(text="x", matched=None),
        StopCheck(text="", matched=None),
        StopCheck(text="", matched="STOP"),
    ]


def test_include_stop_str_in_output_keeps_it_and_cuts_after_it():
    matcher = StopStringMatcher(["STOP"], include_stop_str_in_output=True)
    assert feed_all(matcher, ["Hello ST", "OP and more"]) == [
        StopCheck(text="Hello ST", matched=None),
        StopCheck(text="OP", matched="STOP"),
    ]


def test_include_stop_str_in_output_with_text_after_it_in_the_same_delta():
    matcher = StopStringMatcher(["END"], include_stop_str_in_output=True)
    assert matcher.feed("a END b") == StopCheck(text="a END", matched="END")


def test_held_back_text_is_released_when_no_stop_string_follows():
    matcher = StopStringMatcher(["STOP"])
    assert feed_all(matcher, ["Hello ST", "ART now"]) == [
        StopCheck(text="Hello ", matched=None),
        StopCheck(text="START now", matched=None),
    ]


def test_text_that_cannot_start_a_stop_string_is_not_held_back():
    matcher = StopStringMatcher(["\n\n"])
    assert matcher.feed("plain words") == StopCheck(text="plain words", matched=None)


def test_first_of_several_stop_strings_to_appear_wins():
    matcher = StopStringMatcher(["\n\n", "User:"])
    assert feed_all(matcher, ["Answer.\n", "\nUser: hi"]) == [
        StopCheck(text="Answer.", matched=None),
        StopCheck(text="", matched="\n\n"),
    ]


def test_later_stop_string_in_the_list_matches_too():
    matcher = StopStringMatcher(["\n\n", "User:"])
    assert feed_all(matcher, ["Answer. Us", "er: hi"]) == [
        StopCheck(text="Answer. ", matched=None),
        StopCheck(text="", matched="User:"),
    ]


def test_stop_strings_completing_in_one_delta_resolve_to_the_one_that_ends_first():
    matcher = StopStringMatcher(["abcd", "bc"])
    assert matcher.feed("xabcd") == StopCheck(text="xa", matched="bc")


def test_stop_string_at_the_very_start_gives_empty_output():
    matcher = StopStringMatcher(["<stop>"])
    assert matcher.feed("<stop> tail") == StopCheck(text="", matched="<stop>")


def test_overlapping_prefix_of_stop_string_is_matched():
    matcher = StopStringMatcher(["aab"])
    assert feed_all(matcher, ["aaa", "b"]) == [
        StopCheck(text="a", matched=None),
        StopCheck(text="", matched="aab"),
    ]


def test_flush_returns_text_held_back_when_generation_ends_otherwise():
    matcher = StopStringMatcher(["###"])
    assert matcher.feed("text ##") == StopCheck(text="text ", matched=None)
    assert matcher.flush() == "##"
    assert matcher.finished


def test_no_stop_strings_passes_text_straight_through():
    matcher = StopStringMatcher([])
    assert matcher.feed("abc") == StopCheck(text="abc", matched=None)
    assert matcher.flush() == ""


def test_feeding_after_a_match_raises():
    matcher = StopStringMatcher(["x"])
    assert matcher.feed("ax") == StopCheck(text="a", matched="x")
    with pytest.raises(RuntimeError, match="after a stop string matched"):
        matcher.feed("more")


def test_empty_stop_string_is_rejected():
    with pytest.raises(ValueError, match="non-empty"):
        StopStringMatcher(["ok", ""])


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize(
    "text",
    ["no stop here at all", "one two\n\nthree", "ends with END", "ENDing early", "a\nb\nc\n\n"],
)
def test_char_by_char_feeding_gives_the_same_output_as_one_delta(text, include):
    def run(deltas: list[str]) -> tuple[str, str | None]:
        matcher = StopStringMatcher(["\n\n", "END"], include_stop_str_in_output=include)
        results = feed_all(matcher, deltas)
        out = "".join(r.text for r in results)
        matched = results[-1].matched
        return (out if matched else out + matcher.flush()), matched

    assert run(list(text)) == run([text])
