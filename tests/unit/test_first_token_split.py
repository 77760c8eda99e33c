"""split_final (router/routing/first_token.py): which part of the stream's last delta may go
before the late Prefill reply, and which waits for it."""

from __future__ import annotations

import asyncio

from router.routing.first_token import split_final
from router.serving.backend import TokenDelta


_LOOP = asyncio.new_event_loop()  # futures need a loop; none runs: the reply is out or done


def _pending() -> asyncio.Future:
    return _LOOP.create_future()


def test_a_final_delta_sends_its_tokens_now_and_keeps_only_the_finish_while_the_reply_is_out():
    delta = TokenDelta((4, 5), finish_reason="length", sampled_at=(1.0, 2.0), num_cached_tokens=16)
    head, rest = split_final(delta, _pending())
    assert (head.token_ids, head.finish_reason, head.sampled_at) == ((4, 5), None, (1.0, 2.0))
    assert (rest.token_ids, rest.finish_reason, rest.sampled_at, rest.num_cached_tokens) == ((), "length", (), 16)


def test_a_user_stop_token_stays_with_its_finish():
    delta = TokenDelta((4, 99), finish_reason="stop", stop_token_id=99, sampled_at=(1.0, 2.0))
    head, rest = split_final(delta, _pending())
    assert (head.token_ids, head.stop_token_id, head.finish_reason) == ((4,), None, None)
    assert (rest.token_ids, rest.stop_token_id, rest.finish_reason, rest.sampled_at) == ((99,), 99, "stop", (2.0,))


def test_nothing_is_split_when_the_reply_is_in_or_the_delta_does_not_finish():
    done = _pending()
    done.set_result(None)
    final, middle = TokenDelta((4,), finish_reason="length"), TokenDelta((4,))
    assert split_final(final, done) == (None, final)
    assert split_final(middle, _pending()) == (None, middle)
    assert split_final(final, None) == (None, final)
    only_stop = TokenDelta((99,), finish_reason="stop", stop_token_id=99)
    assert split_final(only_stop, _pending()) == (None, only_stop)
