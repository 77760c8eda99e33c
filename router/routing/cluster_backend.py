"""The P/D cluster as a GenerationBackend: decode reserves, prefill pushes, decode streams.

For one backend request:
  1. refuse at once what can never fit: prompt + max_tokens above every decode worker's whole
     KV cache (400 with the numbers);
  2. admission (router/routing/admission.py): choose (prefill, decode) from the cluster snapshot (a
     pure policy) and call Decode on the decode worker -> its first event is the ticket, or
     its marked no-room refusal (then the next decode worker is tried); nobody has room -> wait
     in the router's FIFO queue, or 503 + Retry-After when the queue's bounds are hit; any
     other refusal is the request's own error at once (it never holds the queue);
  3. Prefill RPC with the ticket on the prefill worker -> first token; a prefill worker
     that fails is replaced by the next one with the same ticket; when none is left, the
     reservation is dropped and the decode worker prefills the prompt itself (a counted
     fallback, path "colocated");
  4. the first token goes to the client, then the decode stream's tokens. A decode worker that
     streams the first token itself (DecodeRequest.stream_first_token) may bring it before the
     Prefill reply: whichever is first is sent, once (router/routing/first_token.py).
Every request carries a BackendTrace (router/serving/trace.py) on its first delta: the times of
its reservation, prefill and first token, and its route and KV transfer, for its timeline.
Leaving early (client gone, stop string, error) aborts the request on both workers. Every end
tells the admission queue how many blocks were freed. Every call has a deadline
(router/routing/worker_calls.py): a decode stream silent for stream_idle_s ends with an explicit error.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace

import grpc

from proto.convert import params_to_proto
from proto.internal_auth import internal_channel
from proto.pdserve.v1 import worker_pb2, worker_pb2_grpc
from router.ops.timeline import RouteSummary
from router.routing.admission import AdmissionQueue, AdmissionSettings
from router.routing.first_token import (
    FirstToken, next_event, race_first_token, settle_prefill, skip_delivered, split_final)
from router.serving.backend import BackendRequest, RouteInfo, TokenDelta
from router.serving.trace import BackendTrace
from router.cluster.state import ClusterSnapshot
from router.errors import InvalidRequest, Overloaded, WorkerFailure
from router.routing.policy import RouteDecision, RouteRequest, prompt_blocks
from router.routing.worker_calls import (
    WorkerSilent, WorkerTimeouts, decode_call_error, is_no_room, read_within, request_error)

logger = logging.getLogger(__name__)

from router.routing.worker_replies import (  # noqa: F401 (the paths are imported from here too)
    PATH_COLOCATED, PATH_DISAGGREGATED, reply_delta, stream_delta, streams_first_token, trace_prefill,
    trace_reserve, wire_seconds)

RouteRequestBuilder = Callable[[tuple[int, ...], "int | None", ClusterSnapshot], RouteRequest]
"""Builds a policy's view of a request (the prefix index fills in cached blocks)."""


def plain_route_request(prompt: tuple[int, ...], max_tokens: int | None, snapshot: ClusterSnapshot) -> RouteRequest:
    return RouteRequest(len(prompt), max_tokens)


@dataclass
class TransferTotals:
    """KV transfers and failovers as seen by this router (for /metrics)."""

    count: int = 0
    nbytes: int = 0
    seconds: float = 0.0
    prefill_retries: int = 0
    decode_rejections: int = 0
    by_link: dict[tuple[str, str], "LinkTotals"] = field(default_factory=dict)
    """Per (prefill worker, decode worker): what crossed that data channel."""

    def add(self, prefill_id: str, decode_id: str, nbytes: int, seconds: float) -> None:
        self.count += 1
        self.nbytes += nbytes
        self.seconds += seconds
        link = self.by_link.setdefault((prefill_id, decode_id), LinkTotals())
        link.count += 1
        link.nbytes += nbytes
        link.seconds += seconds


@dataclass
class LinkTotals:
    """KV transfers over one prefill -> decode data channel."""

    count: int = 0
    nbytes: int = 0
    seconds: float = 0.0


@dataclass
class _Placement:
    decode_address: str
    block_size: int
    prefill_address: str | None = None


@dataclass(frozen=True)
class _Admitted:
    snapshot: ClusterSnapshot
    decision: RouteDecision
    decode_id: str
    stream: object  # grpc.aio stream of DecodeEvent
    ticket: worker_pb2.Ticket


def check_fits_capacity(num_prompt_tokens: int, max_tokens: int | None, snapshot: ClusterSnapshot) -> None:
    """Raises InvalidRequest, with the numbers, when prompt + max_tokens exceeds the whole KV
    cache of every decode worker (it could never run, however long it waited)."""
    decoders = snapshot.decode_workers()
    if not decoders or max_tokens is None:
        return
    largest = max(decoders, key=lambda w: w.total_blocks * w.block_size)
    holds = largest.total_blocks * largest.block_size
    need = num_prompt_tokens + max_tokens
    if need > holds:
        raise InvalidRequest(
            f"This request needs {need:,} tokens of KV cache ({num_prompt_tokens:,} prompt + "
            f"{max_tokens:,} max_tokens), but the largest decode worker holds {holds:,} tokens "
            f"({largest.total_blocks:,} blocks x {largest.block_size}). Reduce the prompt or "
            "max_tokens.",
            param="max_tokens",
        )


class ClusterBackend:
    def __init__(
        self,
        snapshot: Callable[[], Awaitable[ClusterSnapshot]],
        choose: Callable[[RouteRequest, ClusterSnapshot, random.Random], RouteDecision | None],
        ticket_timeout_s: float = 60.0,
        rng: random.Random | None = None,
        admission: AdmissionQueue | None = None,
        route_request: RouteRequestBuilder = plain_route_request,
        timeouts: WorkerTimeouts = WorkerTimeouts(),
        secret: bytes | None = None,
    ) -> None:
        """secret: the cluster secret every call to a worker proves (proto/internal_auth.py);
        None only for tests whose workers are in-process doubles without the check."""
        self._secret = secret
        self._snapshot = snapshot
        self._choose = choose
        self._route_request = route_request
        self._ticket_timeout_ms = int(ticket_timeout_s * 1000)
        self.timeouts = timeouts
        self._background: set[asyncio.Task] = set()
        """Aborts sent to silent workers, not awaited by the request they end."""
        self._rng = rng or random.Random()
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._placements: dict[str, _Placement] = {}
        self.admission = admission or AdmissionQueue(AdmissionSettings())
        self.transfers = TransferTotals()
        self.decisions: Counter[tuple[str, str]] = Counter()
        """Routing decisions by (prefill worker or "-", decode worker)."""
        self.fallbacks: Counter[str] = Counter()
        """Requests that left their planned path, by reason."""
        self.rejections: Counter[str] = Counter()
        """Requests refused before admission, by reason (the queue counts its own)."""
        self.last_decision: RouteDecision | None = None
        self.kv_reader = None
        """The router's KVEventReader when it has one (started and closed by its owner)."""
        self._prefill_tokens: dict[str, tuple[str, int]] = {}
        """request id -> (prefill worker, uncached prompt tokens) for prefills in flight."""

    def channel(self, address: str) -> grpc.aio.Channel:
        """The pooled channel to a worker (every call carries the cluster-secret proof); shared
        with the ops calls (drain), closed by close()."""
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = (
                grpc.aio.insecure_channel(address) if self._secret is None
                else internal_channel(address, self._secret))
        return channel

    async def close(self) -> None:
        for task in list(self._background):
            task.cancel()
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()

    async def generate(self, request: BackendRequest) -> AsyncIterator[TokenDelta]:
        prompt, max_tokens = request.prompt_token_ids, request.params.max_tokens
        trace = BackendTrace()
        trace.mark("backend_start")
        snapshot = await self._snapshot()
        try:
            check_fits_capacity(len(prompt), max_tokens, snapshot)
        except InvalidRequest:
            self.rejections["exceeds_kv_capacity"] += 1
            raise
        block_size = min((w.block_size for w in snapshot.decode_workers()), default=16)
        admitted, queue_s = await self.admission.admit(
            lambda: self._try_admit(request, trace), prompt_blocks(len(prompt), block_size))
        trace.queue_s = queue_s
        generated = 0
        finished = silent = False
        late_prefill: asyncio.Task | None = None
        pending: asyncio.Task | None = None
        try:
            route = self._route_info(admitted, queue_s, None, trace)
            path = PATH_COLOCATED if admitted.decision.prefill_id is None else PATH_DISAGGREGATED
            skip, untold = 0, trace  # untold: the trace rides on the first delta
            if path == PATH_DISAGGREGATED:
                race = await self._first_token(request, admitted, trace)
                if race.first is None:  # every prefill worker failed: this decode worker prefills
                    admitted = await self._admit_local(request, admitted)
                    path, route = PATH_COLOCATED, self._route_info(admitted, queue_s, "prefill_failed", trace)
                else:
                    late_prefill, pending, skip = race.prefill, race.pending_read, race.skip
                    first = race.first
                    if race.from_stream:  # the decode worker's own cache hit; the prefill's comes later
                        first = replace(first, num_cached_tokens=admitted.ticket.num_cached_tokens)
                    first = await self._with_prefill_cache_hit(first, late_prefill)
                    generated += len(first.token_ids)
                    finished = first.finish_reason is not None
                    trace.mark("first_token")
                    yield replace(first, route=route, trace=trace)
                    route = untold = None
                    if finished:
                        return
            stream, wait_s = admitted.stream, self._first_read_s(path)
            what = f"decode worker {admitted.decode_id}"
            while (event := await next_event(stream, pending, wait_s, what)) is not grpc.aio.EOF:
                pending, wait_s = None, self.timeouts.stream_idle_s
                delta, skip = skip_delivered(stream_delta(event, path, route), skip)
                if delta is None:
                    continue
                head, delta = split_final(delta, late_prefill)
                if head is not None:  # its tokens go now; the finish waits for the Prefill reply
                    generated += len(head.token_ids)
                    yield head
                delta = await self._with_prefill_cache_hit(delta, late_prefill)
                if untold is not None:
                    trace.mark("first_token")
                    delta, untold = replace(delta, trace=trace), None
                route = None
                generated += len(delta.token_ids)
                finished = delta.finish_reason is not None
                yield delta
                if finished:
                    return
            raise WorkerFailure("the decode worker ended the stream before the request finished")
        except WorkerSilent:
            silent = True
            raise
        except grpc.aio.AioRpcError as exc:
            raise WorkerFailure(f"decode worker failed mid-stream: {exc.code().name}: {exc.details()}") from exc
        finally:
            if pending is not None:  # left before reading what the stream sent after the reply
                pending.cancel()
            if late_prefill is not None:
                await settle_prefill(late_prefill, finished, self.timeouts.abort_s)
            self._prefill_tokens.pop(request.request_id, None)
            placement = self._placements.get(request.request_id)
            if silent and placement is not None:  # its abort may wait out its deadline: the client hears now
                self._in_background(self._abort_placement(request.request_id, placement))
            elif not finished:
                await self.abort(request.request_id)
            self._placements.pop(request.request_id, None)
            if placement is not None:
                self.admission.blocks_freed(prompt_blocks(len(prompt) + generated, placement.block_size))

    async def _first_token(self, request: BackendRequest, admitted: _Admitted, trace: BackendTrace) -> FirstToken:
        """The first token from the Prefill reply or the decode stream, whichever is first
        (router/routing/first_token.py); first None when every prefill worker failed."""
        settled = asyncio.Event()
        race = await race_first_token(self._prefill_or_fall_back(request, admitted, trace, settled),
                                      admitted.stream, settled, admitted.ticket.first_token_on_stream,
                                      lambda event: stream_delta(event, PATH_DISAGGREGATED, None))
        if race.first is not None:
            trace.prefill["first_token_from"] = "stream" if race.from_stream else "prefill_reply"
        return race

    async def _with_prefill_cache_hit(self, delta: TokenDelta, late_prefill: asyncio.Task | None) -> TokenDelta:
        """When the stream brought the first token, the Prefill reply (with the prefill worker's
        prefix-cache hit, part of the usage's cached tokens) may still be on its way: it rides on
        the first delta after it arrives, and the final delta waits for it (bounded)."""
        if late_prefill is None:
            return delta
        if delta.finish_reason is not None and not late_prefill.done():
            await asyncio.wait({late_prefill}, timeout=self.timeouts.abort_s)
        if not late_prefill.done() or late_prefill.cancelled() or late_prefill.exception() is not None:
            return delta
        reply = late_prefill.result()
        if reply is None or reply.num_cached_tokens <= delta.num_cached_tokens:
            return delta
        return replace(delta, num_cached_tokens=reply.num_cached_tokens)

    def _first_read_s(self, path: str) -> float:
        """After a local admission the decode worker computes the prompt before its first token."""
        if path == PATH_COLOCATED:
            return max(self.timeouts.prefill_s, self.timeouts.stream_idle_s)
        return self.timeouts.stream_idle_s

    def _in_background(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _route_info(self, admitted: _Admitted, queue_s: float, fallback: str | None,
                    trace: BackendTrace) -> RouteInfo:
        d = admitted.decision
        prefill = None if fallback else d.prefill_id
        trace.route = RouteSummary(prefill, admitted.decode_id, d.reason, d.inputs, fallback)
        return RouteInfo(admitted.decode_id, prefill, d.reason, d.inputs, queue_s, fallback)

    async def _try_admit(self, request: BackendRequest, trace: BackendTrace | None = None) -> _Admitted | None:
        """One admission attempt on a fresh snapshot; None when no decode worker has room.
        `trace` gets the successful attempt's reservation (its Decode call until the ticket)."""
        snapshot = self._with_own_load(await self._snapshot())
        route = self._route_request(request.prompt_token_ids, request.params.max_tokens, snapshot)
        decision = self._choose(route, snapshot, self._rng)
        if decision is None:
            self.rejections["no_decode_worker"] += 1
            raise Overloaded("no decode worker is registered", retry_after_s=5.0)
        self.last_decision = decision
        logger.debug("route %s: %s %s", request.request_id, decision.reason, decision.inputs)
        local = decision.prefill_id is None  # the decode worker does it all
        reserve_start = time.monotonic()
        admitted = await self._admit(request, snapshot, decision, local)
        if admitted is not None:
            if trace is not None:
                trace_reserve(trace, reserve_start, admitted)
            self.decisions[(decision.prefill_id or "-", admitted.decode_id)] += 1
            if local and snapshot.prefill_workers():
                self.fallbacks["local_prefill"] += 1  # conditional disaggregation: counted, not silent
            self._note_sent(request, route, admitted)
        return admitted

    def _note_sent(self, request: BackendRequest, route: RouteRequest, admitted: _Admitted) -> None:
        """Count the prefill this router just sent (until it returns) and expect both workers
        to cache the prompt, so the next requests see them before heartbeats and events do."""
        prefill_id = admitted.decision.prefill_id
        if prefill_id is not None:
            info = admitted.snapshot.by_id(prefill_id)
            cached = route.cached_for(prefill_id) * (info.block_size if info else 0)
            self._prefill_tokens[request.request_id] = (prefill_id, max(len(request.prompt_token_ids) - cached, 0))
        if self.kv_reader is not None:
            workers = [w for w in (prefill_id, admitted.decode_id) if w is not None]
            self.kv_reader.note_routed(workers, request.prompt_token_ids, admitted.snapshot)

    def _with_own_load(self, snapshot: ClusterSnapshot) -> ClusterSnapshot:
        """The snapshot with each prefill worker's queue at least the prefill tokens this
        router has sent it and not seen back (heartbeats are up to an interval old)."""
        own: Counter[str] = Counter()
        for worker_id, tokens in self._prefill_tokens.values():
            own[worker_id] += tokens
        if not own:
            return snapshot
        workers = tuple(
            replace(w, queued_prefill_tokens=max(w.queued_prefill_tokens, own[w.worker_id]))
            if own[w.worker_id] else w for w in snapshot.workers)
        return ClusterSnapshot(workers=workers, taken_at=snapshot.taken_at, stale=snapshot.stale)

    async def _admit(self, request: BackendRequest, snapshot: ClusterSnapshot, decision: RouteDecision,
                     local: bool) -> _Admitted | None:
        """Decode call on the chosen decode worker, then the others; None when all refuse."""
        candidates = [decision.decode_id] + [
            w.worker_id for w in snapshot.decode_workers() if w.worker_id != decision.decode_id]
        for worker_id in candidates:
            info = snapshot.by_id(worker_id)
            if info is None:
                continue
            stub = worker_pb2_grpc.DecodeWorkerStub(self.channel(info.address))
            stream = stub.Decode(worker_pb2.DecodeRequest(
                request_id=request.request_id, prompt_token_ids=list(request.prompt_token_ids),
                sampling=params_to_proto(request.params), ticket_timeout_ms=self._ticket_timeout_ms,
                local_prefill=local, stream_first_token=streams_first_token(request, local)))
            try:
                first = await read_within(stream, self.timeouts.stream_idle_s, f"decode worker {worker_id}")
            except grpc.aio.AioRpcError as exc:
                if is_no_room(exc):
                    self.transfers.decode_rejections += 1
                    continue
                if exc.code() == grpc.StatusCode.UNAVAILABLE:  # gone: the others may take it
                    continue
                raise decode_call_error(exc, worker_id) from exc
            except WorkerSilent as exc:  # stopped or wedged: the others may take it
                logger.warning("%s; trying the next decode worker", exc)
                self._in_background(self._abort_on(worker_pb2_grpc.DecodeWorkerStub, info.address,
                                                   request.request_id))
                continue
            except BaseException:  # cancelled while waiting: the stream must not outlive us
                stream.cancel()
                raise
            if first is grpc.aio.EOF or not first.HasField("ticket"):
                stream.cancel()
                raise WorkerFailure(f"decode worker {worker_id} answered without a ticket")
            self._placements[request.request_id] = _Placement(info.address, info.block_size)
            return _Admitted(snapshot, decision, worker_id, stream, first.ticket)
        return None

    async def _admit_local(self, request: BackendRequest, admitted: _Admitted) -> _Admitted:
        """Drop the ticketed reservation and have the same decode worker prefill itself."""
        admitted.stream.cancel()  # type: ignore[attr-defined]
        await self.abort(request.request_id)
        self.fallbacks["prefill_failed"] += 1
        decision = RouteDecision(None, admitted.decode_id, admitted.decision.reason + " (prefill fallback)",
                                 admitted.decision.inputs)
        local = await self._admit(request, admitted.snapshot, decision, local=True)
        if local is None:
            raise WorkerFailure("no prefill worker could serve the request and no decode worker took it back")
        return local

    async def _prefill_or_fall_back(self, request: BackendRequest, admitted: _Admitted, trace: BackendTrace,
                                    settled: asyncio.Event) -> TokenDelta | None:
        """The first token from a prefill worker, trying each in turn; None when all failed, or
        when the decode stream brought the first token (`settled`) before one succeeded."""
        snapshot, decision, ticket = admitted.snapshot, admitted.decision, admitted.ticket
        ordered = [w.worker_id for w in snapshot.prefill_workers() if w.worker_id != admitted.decode_id]
        if decision.prefill_id in ordered:
            ordered.remove(decision.prefill_id)
            ordered.insert(0, decision.prefill_id)
        try:
            for attempt, worker_id in enumerate(ordered, start=1):
                info = snapshot.by_id(worker_id)
                if info is None or settled.is_set():
                    continue
                self._placements[request.request_id].prefill_address = info.address
                stub = worker_pb2_grpc.PrefillWorkerStub(self.channel(info.address))
                sent_at = time.monotonic()
                try:
                    reply = await stub.Prefill(worker_pb2.PrefillRequest(
                        request_id=request.request_id, prompt_token_ids=list(request.prompt_token_ids),
                        sampling=params_to_proto(request.params), ticket=ticket), timeout=self.timeouts.prefill_s)
                except grpc.aio.AioRpcError as exc:
                    if settled.is_set():  # the KV had arrived: nothing to retry
                        return None
                    if (error := request_error(exc)) is not None:  # another prefill worker would refuse it too
                        raise error from exc
                    self.transfers.prefill_retries += 1
                    logger.warning("prefill of %s on %s failed (%s: %s); trying the next prefill worker",
                                   request.request_id, worker_id, exc.code().name, exc.details())
                    continue
                self.transfers.add(worker_id, admitted.decode_id, reply.transfer.bytes, wire_seconds(reply.transfer))
                trace_prefill(trace, worker_id, attempt, time.monotonic() - sent_at, reply,
                               ticket.num_cached_tokens // max(info.block_size, 1))
                return reply_delta(reply, ticket)
        finally:
            self._prefill_tokens.pop(request.request_id, None)
        if not settled.is_set():
            logger.warning("no prefill worker could serve %s; the decode worker prefills it", request.request_id)
        return None

    async def abort(self, request_id: str) -> None:
        placement = self._placements.pop(request_id, None)
        if placement is not None:
            await self._abort_placement(request_id, placement)

    async def _abort_placement(self, request_id: str, placement: _Placement) -> None:
        calls = [(worker_pb2_grpc.DecodeWorkerStub, placement.decode_address)]
        if placement.prefill_address:
            calls.append((worker_pb2_grpc.PrefillWorkerStub, placement.prefill_address))
        for stub_type, address in calls:
            await self._abort_on(stub_type, address, request_id)

    async def _abort_on(self, stub_type, address: str, request_id: str) -> None:
        try:
            await stub_type(self.channel(address)).Abort(
                worker_pb2.AbortRequest(request_id=request_id), timeout=self.timeouts.abort_s)
        except grpc.aio.AioRpcError as exc:  # the worker may be gone; nothing to free there
            logger.info("abort of %s on %s failed: %s", request_id, address, exc.code().name)
