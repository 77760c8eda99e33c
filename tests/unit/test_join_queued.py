"""join_queued (router/routing/worker_replies.py): the token chunks a link has already received
behind the one just read leave as one delta; nothing is waited for, and gRPC streams, tickets
and finished chunks pass as they are."""

from __future__ import annotations

from proto.pdserve.v1 import common_pb2, worker_pb2
from router.routing.worker_replies import join_queued


def chunk(ids, finish="", sampled=None, stop=-1):
    return worker_pb2.DecodeEvent(tokens=worker_pb2.TokenChunk(
        token_ids=ids, finish_reason=finish, stop_token_id=stop, sampled_at=sampled or []))


class Queued:
    """A stream that holds these responses already (as a LinkStreamCall does)."""

    def __init__(self, *events):
        self.events = list(events)

    def read_nowait(self):
        return self.events.pop(0) if self.events else None


def test_chunks_received_behind_the_one_read_join_it_in_order_with_the_last_ones_finish():
    stream = Queued(chunk([11], sampled=[2.0]), chunk([12, 13], finish="stop", sampled=[3.0, 3.0], stop=13))
    joined = join_queued(stream, chunk([10], sampled=[1.0]))
    assert list(joined.tokens.token_ids) == [10, 11, 12, 13]
    assert list(joined.tokens.sampled_at) == [1.0, 2.0, 3.0, 3.0]
    assert (joined.tokens.finish_reason, joined.tokens.stop_token_id) == ("stop", 13)
    assert stream.events == []


def test_sample_times_are_dropped_when_one_chunk_lacks_them():
    joined = join_queued(Queued(chunk([11])), chunk([10], sampled=[1.0]))
    assert list(joined.tokens.token_ids) == [10, 11] and list(joined.tokens.sampled_at) == []


def test_nothing_queued_a_finished_chunk_a_ticket_and_a_grpc_stream_pass_unchanged():
    event = chunk([10])
    assert join_queued(Queued(), event) is event
    finished = chunk([10], finish="length")
    stream = Queued(chunk([11]))
    assert join_queued(stream, finished) is finished and len(stream.events) == 1
    ticket = worker_pb2.DecodeEvent(ticket=worker_pb2.Ticket(ticket_id=3))
    assert join_queued(stream, ticket) is ticket and len(stream.events) == 1
    assert join_queued(object(), event) is event  # no read_nowait: a gRPC call


def test_nothing_past_a_finished_chunk_is_taken():
    stream = Queued(chunk([11], finish="length"), chunk([99]))
    joined = join_queued(stream, chunk([10]))
    assert list(joined.tokens.token_ids) == [10, 11] and joined.tokens.finish_reason == "length"
    assert [list(e.tokens.token_ids) for e in stream.events] == [[99]]  # left for read(): a protocol error there


def test_a_stop_token_id_0_and_every_logprob_survive_the_join():
    """The join parses the parts' bytes laid end to end (a protobuf merge): a last chunk's stop
    token id 0 is a default, not serialized, and must still win over the earlier chunks' -1."""
    def with_logprob(ids, **kw):
        event = chunk(ids, **kw)
        for token_id in ids:
            event.tokens.logprobs.add(token_id=token_id, logprob=-0.5 * token_id, rank=1,
                                      top=[common_pb2.TopLogprob(token_id=token_id, logprob=-0.1)])
        return event

    stream = Queued(with_logprob([11]), with_logprob([0], finish="stop", stop=0))
    joined = join_queued(stream, with_logprob([10]))
    assert list(joined.tokens.token_ids) == [10, 11, 0]
    assert (joined.tokens.finish_reason, joined.tokens.stop_token_id) == ("stop", 0)
    assert [(lp.token_id, lp.logprob, [t.token_id for t in lp.top]) for lp in joined.tokens.logprobs] == [
        (10, -5.0, [10]), (11, -5.5, [11]), (0, 0.0, [0])]
