"""LayerFeed (kv_transfer/layers.py): the hand-over of a transfer's layers from the engine
thread to a sender's thread — what arrives, what wakes a waiting sender, and what ends it."""

from __future__ import annotations

import threading

import pytest
import torch

from kv_transfer.base import DTypeCode, TransferHeader
from kv_transfer.layers import FeedCancelled, LayerFeed

HEADER = TransferHeader(5, 0, num_layers=2, num_blocks=1, block_size=4, num_kv_heads=1, head_dim=2,
                        dtype=DTypeCode.FLOAT32)


def test_a_layer_put_on_another_thread_wakes_the_waiting_sender_and_leaves_the_feed():
    feed, layer = LayerFeed(HEADER), torch.arange(16, dtype=torch.float32).view(2, 1, 4, 1, 2)
    threading.Timer(0.05, feed.put, (1, layer)).start()
    assert feed.get(1, 5.0) is layer
    with pytest.raises(FeedCancelled, match="layer 1 not computed within 0.01 s"):
        feed.get(1, 0.01)  # taken once; waiting again times out, which cancels the feed
    assert feed.cancelled == "layer 1 not computed within 0.01 s"


def test_finish_gives_the_first_token_and_its_sample_time_in_microseconds():
    feed = LayerFeed(HEADER)
    threading.Timer(0.05, feed.finish, (4242, 1_790_000_000.5)).start()
    assert feed.trailer(5.0) == (4242, 1_790_000_000_500_000)


def test_cancel_wakes_a_waiting_sender_and_drops_later_puts():
    feed = LayerFeed(HEADER)
    threading.Timer(0.05, feed.cancel, ("request r was aborted",)).start()
    with pytest.raises(FeedCancelled, match="request r was aborted"):
        feed.get(0, 5.0)
    feed.put(0, torch.zeros(2, 1, 4, 1, 2))
    feed.finish(1, None)  # too late: the feed stays cancelled
    with pytest.raises(FeedCancelled, match="request r was aborted"):
        feed.get(0, 0.01)


def test_cancel_after_finish_changes_nothing_and_a_layer_out_of_range_is_refused():
    feed = LayerFeed(HEADER)
    feed.finish(7, None)
    feed.cancel("late")
    assert (feed.cancelled, feed.trailer(0.01)) == (None, (7, 0))
    with pytest.raises(ValueError, match="layer 2 out of range for 2 layers"):
        feed.put(2, torch.zeros(2, 1, 4, 1, 2))


def test_ready_and_finished_say_whether_get_and_trailer_would_wait():
    feed = LayerFeed(HEADER)
    assert (feed.ready(0), feed.ready(1), feed.finished()) == (False, False, False)
    feed.put(0, torch.zeros(1))
    assert (feed.ready(0), feed.ready(1), feed.finished()) == (True, False, False)
    feed.finish(5, None)
    assert feed.finished() is True
    cancelled = LayerFeed(HEADER)
    cancelled.cancel("gone")
    assert (cancelled.ready(1), cancelled.finished()) == (True, True)


def test_on_finish_runs_the_post_on_the_finishing_thread_once_and_posted_gives_its_result():
    feed, ran_on = LayerFeed(HEADER), []

    def post(first):
        ran_on.append((threading.current_thread().name, first))
        return "work"
    feed.on_finish(post)
    assert ran_on == []  # nothing until the token exists
    finisher = threading.Thread(target=feed.finish, args=(4242, 1.5), name="engine")
    finisher.start()
    finisher.join(5)
    assert feed.posted(5.0) == "work"
    feed.finish(1, None)  # a second finish does not post again
    assert ran_on == [("engine", (4242, 1_500_000))]


def test_on_finish_after_finish_posts_at_once_and_never_for_a_cancelled_feed():
    done, ran = LayerFeed(HEADER), []
    done.finish(7, None)
    done.on_finish(lambda first: ran.append(first) or "now")
    assert (ran, done.posted(0.01)) == ([(7, 0)], "now")
    cancelled = LayerFeed(HEADER)
    cancelled.on_finish(lambda first: ran.append(first))
    cancelled.cancel("request r was aborted")
    cancelled.finish(8, None)
    assert ran == [(7, 0)]
    with pytest.raises(FeedCancelled, match="request r was aborted"):
        cancelled.posted(0.01)


def test_what_the_post_raises_is_raised_to_the_consumer_not_the_producer():
    feed = LayerFeed(HEADER)

    def post(first):
        raise RuntimeError("the channel is gone")
    feed.on_finish(post)
    feed.finish(1, None)  # the engine thread goes on
    with pytest.raises(RuntimeError, match="the channel is gone"):
        feed.posted(0.01)


def test_a_post_that_returns_none_still_runs_once():
    feed, ran = LayerFeed(HEADER), []
    feed.on_finish(ran.append)
    feed.finish(3, None)
    feed.finish(3, None)
    assert (ran, feed.posted(0.01)) == ([(3, 0)], None)
