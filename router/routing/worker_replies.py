"""Worker replies into the router's terms: DecodeEvents and Prefill replies into TokenDeltas,
and what they say about the request's path into its BackendTrace."""

from __future__ import annotations

from typing import TYPE_CHECKING

from proto.pdserve.v1 import worker_pb2
from router.ops.timeline import TransferSummary
from router.serving.backend import BackendRequest, RouteInfo, TokenDelta
from router.serving.trace import BackendTrace
from router.serving.types import TokenLogprobs

if TYPE_CHECKING:
    from router.routing.cluster_backend import _Admitted

PATH_DISAGGREGATED = "disaggregated"
PATH_COLOCATED = "colocated"


def _logprobs(msg) -> TokenLogprobs:
    return TokenLogprobs(msg.token_id, msg.logprob, msg.rank, tuple((t.token_id, t.logprob) for t in msg.top))


def stream_delta(event, path: str, route: RouteInfo | None) -> TokenDelta:
    chunk = event.tokens
    return TokenDelta(
        token_ids=tuple(chunk.token_ids),
        logprobs=tuple(_logprobs(lp) for lp in chunk.logprobs),
        finish_reason=chunk.finish_reason or None,
        stop_token_id=chunk.stop_token_id if chunk.stop_token_id >= 0 else None,
        path=path,
        route=route,
        sampled_at=tuple(chunk.sampled_at) if len(chunk.sampled_at) == len(chunk.token_ids) else (),
    )


def join_queued(stream, event):
    """`event` with the token chunks already received behind it joined in (one delta, so one
    SSE event, instead of one per chunk): a router that falls behind a stream catches up
    instead of queuing. A chunk is never held back for more; streams that cannot tell what
    they hold (gRPC's) give `event` as it is."""
    read_nowait = getattr(stream, "read_nowait", None)
    if read_nowait is None or event.WhichOneof("event") != "tokens" or event.tokens.finish_reason:
        return event
    part = read_nowait()
    if part is None:
        return event
    parts = list(_up_to_the_finish(event, part, read_nowait))
    # Serialized messages laid end to end parse as one merged message: the repeated fields
    # (token ids, logprobs, sample times) come out appended in order, at a fifth of the cost of
    # extending each field per part. Scalars merge as "last set wins", and a default (a stop
    # token id 0, an empty finish reason) is not serialized, so the last part's are set here.
    joined = worker_pb2.DecodeEvent.FromString(b"".join([p.SerializeToString() for p in parts]))
    chunk, last = joined.tokens, parts[-1].tokens
    chunk.finish_reason, chunk.stop_token_id = last.finish_reason, last.stop_token_id
    if not all(len(p.tokens.sampled_at) == len(p.tokens.token_ids) for p in parts):
        del chunk.sampled_at[:]
    return joined


def _up_to_the_finish(first, second, read_nowait):
    """first, second, then what read_nowait() has, stopping at a finished chunk (nothing is
    taken past it)."""
    yield first
    part = second
    while part is not None:
        yield part
        if part.tokens.finish_reason:
            return
        part = read_nowait()


def reply_delta(reply: worker_pb2.PrefillResponse, ticket: worker_pb2.Ticket) -> TokenDelta:
    """The Prefill reply's first token (its sample time when the worker reported it)."""
    sampled = reply.timing.first_token_at if reply.HasField("timing") else 0.0
    return TokenDelta(
        token_ids=(reply.first_token_id,),
        logprobs=(_logprobs(reply.first_logprobs),) if reply.HasField("first_logprobs") else (),
        num_cached_tokens=max(ticket.num_cached_tokens, reply.num_cached_tokens),
        path=PATH_DISAGGREGATED,
        sampled_at=(sampled,) if sampled > 0 else (),
    )


def streams_first_token(request: BackendRequest, local: bool) -> bool:
    """Ask the decode worker to stream the prefill's first token, except when the decode worker
    prefills itself (it streams every token anyway) or logprobs are wanted (the data channel
    carries the first token's id only; its logprobs come with the Prefill reply)."""
    return not local and request.params.logprobs is None


def trace_reserve(trace: BackendTrace, started_at: float, admitted: "_Admitted") -> None:
    trace.marks["reserve_start"] = started_at  # the attempt that got the ticket
    trace.mark("ticket")
    ticket = admitted.ticket
    trace.reserve.update(decode=admitted.decode_id, num_cached_tokens=ticket.num_cached_tokens,
                         num_blocks=ticket.num_blocks)


def trace_prefill(trace: BackendTrace, worker_id: str, attempt: int, rpc_s: float,
                   reply: worker_pb2.PrefillResponse, blocks_skipped: int) -> None:
    trace.prefill.update(worker=worker_id, attempts=attempt, rpc_ms=rpc_s * 1000,
                         num_cached_tokens=reply.num_cached_tokens)
    if reply.HasField("timing"):
        trace.prefill.update(worker_queue_ms=reply.timing.queue_s * 1000,
                             worker_compute_ms=reply.timing.compute_s * 1000)
    t = reply.transfer
    trace.transfer = TransferSummary(t.bytes, t.seconds, t.num_blocks, blocks_skipped, t.backend,
                                     reported_wire_seconds(t))


def reported_wire_seconds(transfer: worker_pb2.TransferStats) -> float | None:
    """The seconds a transfer's bytes were on the wire, as its worker reported them (None: an
    older worker that does not)."""
    return transfer.wire_seconds if transfer.HasField("wire_seconds") else None


def wire_seconds(transfer: worker_pb2.TransferStats) -> float:
    """What link GB/s divide by: the reported wire seconds, else the whole doorbell-to-ack
    seconds."""
    reported = reported_wire_seconds(transfer)
    return transfer.seconds if reported is None else reported
