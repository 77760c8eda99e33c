"""The first token of a disaggregated request, from whichever brings it first.

The prefill worker returns the first token in its Prefill reply after the decode worker has
acknowledged the KV; a decode worker asked to (`DecodeRequest.stream_first_token`, and saying
so in its ticket's `first_token_on_stream`) also sends it on the Decode stream as soon as the KV
has arrived, which is usually earlier. The router runs the Prefill call as a task while it reads
the stream and yields the first of the two, exactly once:

  stream first  -> the stream's first chunk starts at position 0; the Prefill call goes on in
                   the background (its reply brings the transfer's numbers; if it fails now,
                   the KV has arrived already, so it is harmless, and no other prefill worker
                   is tried);
  reply first   -> the stream's position-0 token, when it comes, is dropped (by position,
                   never by value: a model may repeat a token);
  the stream ends the request first (a tokenless "abort": the decode worker's ticket expired
                   before the KV came) -> the Prefill call is cancelled and the request falls
                   back as when every prefill worker failed;
  a decode worker that does not stream it (an older one) -> the reply, as before.

The stream's last delta does not wait for the late Prefill reply either: its tokens go at
once (split_final) and only its finish (with the reply's prefix-cache hit in the usage)
waits, bounded. The prefill worker settles its reply between engine steps, seconds after the
KV landed under a queue of long prompts, and the last token used to wait that long.

Failover (the next prefill worker, then the decode worker's own prefill) happens only while no
token has reached the client.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc

from router.errors import WorkerFailure
from router.routing.worker_calls import WorkerSilent, read_within
from router.serving.backend import TokenDelta


@dataclass(frozen=True)
class FirstToken:
    """How the first token arrived."""

    first: TokenDelta | None
    """The first token's delta, or None when every prefill worker failed."""
    from_stream: bool = False
    prefill: asyncio.Task | None = None
    """The Prefill call still running after the stream brought the first token (settle it)."""
    pending_read: asyncio.Task | None = None
    """A read of the decode stream already under way (the reply came first)."""
    skip: int = 0
    """Tokens at the head of the stream the client already has (the reply's first token)."""


async def race_first_token(prefill: Awaitable[TokenDelta | None], stream, settled: asyncio.Event,
                           streams_first: bool, to_delta: Callable[[object], TokenDelta]) -> FirstToken:
    """Runs `prefill` (which stops trying other workers once `settled` is set) against the
    decode stream's first read (a DecodeEvent, made a delta by `to_delta`). Raises what `prefill` raises while it is the only source, the
    stream's AioRpcError, and WorkerFailure for a stream that ends before its first token.
    Cancelled: both are cancelled."""
    task = asyncio.ensure_future(prefill)
    if not streams_first:  # an older decode worker: the reply is the only source
        return FirstToken(await task)
    # A worker-link stream says when a read will not wait (no task for the read); a gRPC
    # stream's read runs as a task, which the next read then continues.
    arrival = getattr(stream, "arrival", None)
    read = arrival() if arrival is not None else asyncio.ensure_future(stream.read())
    try:
        await asyncio.wait({task, read}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        read.cancel()
        raise
    if read.done():
        return await _stream_first(stream, read, task, settled, to_delta)
    try:
        first = task.result()
    except BaseException:
        read.cancel()
        raise
    if first is None:  # nothing was sent: the stream will bring no token
        read.cancel()
        return FirstToken(None)
    return FirstToken(first, pending_read=read if isinstance(read, asyncio.Task) else None, skip=1)


async def _stream_first(stream, read: asyncio.Future, prefill: asyncio.Task, settled: asyncio.Event,
                        to_delta: Callable[[object], TokenDelta]) -> FirstToken:
    """The stream spoke first: `read` is the read task, or the link's arrival (the read then
    returns without waiting)."""
    try:
        event = read.result() if isinstance(read, asyncio.Task) else await stream.read()
    except BaseException:
        prefill.cancel()
        raise
    if event is grpc.aio.EOF or not event.HasField("tokens"):
        prefill.cancel()
        raise WorkerFailure("the decode worker ended the stream before the first token")
    if not event.tokens.token_ids:
        # The decode worker ended the request before its KV came ("abort": the ticket expired
        # while the prefill was queued, or the import failed): no KV can land there now, so the
        # Prefill call is stopped and the request falls back as if it had failed.
        prefill.cancel()
        return FirstToken(None)
    settled.set()
    return FirstToken(to_delta(event), from_stream=True, prefill=prefill)


async def next_event(stream, pending: asyncio.Task | None, timeout_s: float, what: str):
    """The stream's next event: the read already under way if any, else a new one; either way
    WorkerSilent after `timeout_s` of nothing (the call is cancelled then)."""
    if pending is None:
        return await read_within(stream, timeout_s, what)
    try:
        async with asyncio.timeout(timeout_s):
            return await pending
    except TimeoutError:
        stream.cancel()
        raise WorkerSilent(f"{what} sent nothing for {timeout_s:g} s") from None


def _with_tokens(delta: TokenDelta, part: slice, **changes) -> TokenDelta:
    """`delta` keeping only `part` of its per-token fields (ids, logprobs, sample times)."""
    return dataclasses.replace(delta, token_ids=delta.token_ids[part], logprobs=delta.logprobs[part],
                               sampled_at=delta.sampled_at[part], **changes)


def skip_delivered(delta: TokenDelta, skip: int) -> tuple[TokenDelta | None, int]:
    """Drops the first `skip` tokens of `delta` (the client has them already); returns what is
    left (None when nothing is, unless it finishes the request) and the tokens still to skip."""
    if skip == 0:
        return delta, 0
    n = min(skip, len(delta.token_ids))
    rest = _with_tokens(delta, slice(n, None))
    if not rest.token_ids and rest.finish_reason is None:
        return None, skip - n
    return rest, skip - n


def split_final(delta: TokenDelta, late_prefill: asyncio.Task | None) -> tuple[TokenDelta | None, TokenDelta]:
    """(tokens to send now, the rest): a final delta whose Prefill reply is still out gives
    its tokens now without the finish, and keeps the finish (with a user stop token, which
    must stay with it) for after the reply. (None, delta) when nothing need wait."""
    if late_prefill is None or late_prefill.done() or delta.finish_reason is None:
        return None, delta
    n = len(delta.token_ids) - (1 if delta.stop_token_id is not None else 0)
    if n <= 0:
        return None, delta
    head = _with_tokens(delta, slice(None, n), finish_reason=None, stop_token_id=None)
    return head, _with_tokens(delta, slice(n, None), route=None, trace=None)


async def settle_prefill(task: asyncio.Task, finished: bool, wait_s: float) -> None:
    """The Prefill call that outlived the first token: a finished request waits for its reply
    (bounded: the transfer's numbers come with it); an unfinished one cancels it. A failure now
    is harmless (the KV had arrived) and is not raised."""
    if finished and not task.done():
        await asyncio.wait({task}, timeout=wait_s)
    if task.done():  # read its outcome here: gather() would take a pass of the loop for it
        if not task.cancelled():
            task.exception()
        return
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
