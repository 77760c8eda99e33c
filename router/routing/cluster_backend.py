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
from dataclasses import replace

import grpc

from proto.convert import params_to_proto
from proto.pdserve.v1 import worker_pb2
from router.ops.timeline import RouteSummary
from router.routing.admission import AdmissionQueue, AdmissionSettings
from router.routing.first_token import (
    FirstToken, next_event, race_first_token, settle_prefill, skip_delivered, split_final)
from router.serving.backend import BackendRequest, RouteInfo, TokenDelta
from router.serving.trace import BackendTrace
from router.cluster.state import ClusterSnapshot
from router.errors import InvalidRequest, Overloaded, WorkerFailure
from router.routing.pd_request import (  # noqa: F401 (check_fits_capacity, plain_route_request: imported from here too)
    RouteRequestBuilder, _Admitted, _Placement, _Run, check_fits_capacity, plain_route_request)
from router.routing.policy import RouteDecision, RouteRequest, prompt_blocks
from router.routing.prefix_index import PromptHashes
from router.routing.transfer_totals import LinkTotals, TransferTotals  # noqa: F401 (imported from here too)
from router.routing.worker_calls import (
    WorkerSilent, WorkerTimeouts, decode_call_error, is_no_room, read_within, request_error)
from router.routing.worker_client import WorkerClient

logger = logging.getLogger(__name__)

from router.routing.worker_replies import (  # noqa: F401 (the paths are imported from here too)
    PATH_COLOCATED, PATH_DISAGGREGATED, join_queued, reply_delta, stream_delta, streams_first_token,
    trace_prefill, trace_reserve, wire_seconds)

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
        use_links: bool = True,
    ) -> None:
        """secret: the cluster secret every call to a worker proves (proto/internal_auth.py);
        None only for tests whose workers are in-process doubles without the check.
        use_links: the request calls go over the workers' links where they serve one
        (router/routing/worker_client.py); False: over gRPC."""
        self.workers = WorkerClient(secret, use_links)
        self._snapshot = snapshot
        self._choose = choose
        self._route_request = route_request
        self._ticket_timeout_ms = int(ticket_timeout_s * 1000)
        self.timeouts = timeouts
        self._rng = rng or random.Random()
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
        return self.workers.channel(address)

    async def close(self) -> None:
        await self.workers.close()

    async def generate(self, request: BackendRequest) -> AsyncIterator[TokenDelta]:
        trace = BackendTrace()
        trace.mark("backend_start")
        admitted, queue_s = await self._admit_request(request, trace)
        path = PATH_COLOCATED if admitted.decision.prefill_id is None else PATH_DISAGGREGATED
        run = _Run(request, admitted, trace, queue_s, path, self._route_info(admitted, queue_s, None, trace), trace)
        try:
            if run.path == PATH_DISAGGREGATED and (first := await self._disaggregated_first(run)) is not None:
                yield run.count(first)
                if run.finished:
                    return
            stream, wait_s = run.admitted.stream, self._first_read_s(run.path)
            what = f"decode worker {run.admitted.decode_id}"
            while (event := await next_event(stream, run.pending, wait_s, what)) is not grpc.aio.EOF:
                wait_s = self.timeouts.stream_idle_s
                if (delta := self._stream_delta(run, join_queued(stream, event))) is None:
                    continue
                head, delta = split_final(delta, run.late_prefill)
                if head is not None:  # its tokens go now; the finish waits for the Prefill reply
                    yield run.count(head)
                yield run.count(await self._told(run, delta))
                if run.finished:
                    return
            raise WorkerFailure("the decode worker ended the stream before the request finished")
        except WorkerSilent:
            run.silent = True
            raise
        except grpc.aio.AioRpcError as exc:
            raise WorkerFailure(f"decode worker failed mid-stream: {exc.code().name}: {exc.details()}") from exc
        finally:
            await self._end(run)

    async def _admit_request(self, request: BackendRequest, trace: BackendTrace) -> tuple[_Admitted, float]:
        """Refuse what can never fit, then admission (waiting in the queue when nobody has
        room): the admitted placement and the seconds it waited."""
        prompt = request.prompt_token_ids
        snapshot = await self._snapshot()
        try:
            check_fits_capacity(len(prompt), request.params.max_tokens, snapshot)
        except InvalidRequest:
            self.rejections["exceeds_kv_capacity"] += 1
            raise
        block_size = min((w.block_size for w in snapshot.decode_workers()), default=16)
        hashes = PromptHashes(prompt)  # hashed once for every attempt and the note after
        admitted, queue_s = await self.admission.admit(
            lambda: self._try_admit(request, hashes, trace), prompt_blocks(len(prompt), block_size))
        trace.queue_s = queue_s
        return admitted, queue_s

    async def _disaggregated_first(self, run: _Run) -> TokenDelta | None:
        """The first token (with the route and trace on it), or None when every prefill worker
        failed and the decode worker now prefills itself (run.path becomes colocated)."""
        race = await self._first_token(run.request, run.admitted, run.trace)
        if race.first is None:
            run.admitted = await self._admit_local(run.request, run.admitted)
            run.path = PATH_COLOCATED
            run.route = self._route_info(run.admitted, run.queue_s, "prefill_failed", run.trace)
            return None
        run.late_prefill, run.pending, run.skip = race.prefill, race.pending_read, race.skip
        first = race.first
        if race.from_stream:  # the decode worker's own cache hit; the prefill's comes later
            first = replace(first, num_cached_tokens=run.admitted.ticket.num_cached_tokens)
        first = await self._with_prefill_cache_hit(first, run.late_prefill)
        run.trace.mark("first_token")
        first = replace(first, route=run.route, trace=run.trace)
        run.route = run.untold = None
        return first

    def _stream_delta(self, run: _Run, event) -> TokenDelta | None:
        """A decode stream event as a delta; None for tokens the client already has."""
        run.pending = None
        delta, run.skip = skip_delivered(stream_delta(event, run.path, run.route), run.skip)
        return delta

    async def _told(self, run: _Run, delta: TokenDelta) -> TokenDelta:
        """The client's next delta: the late Prefill reply's cache hit and the trace on it."""
        if run.late_prefill is not None:
            delta = await self._with_prefill_cache_hit(delta, run.late_prefill)
        if run.untold is not None:
            run.trace.mark("first_token")
            delta, run.untold = replace(delta, trace=run.trace), None
        run.route = None
        return delta

    async def _end(self, run: _Run) -> None:
        """Every end: settle the prefill, abort what did not finish, free the queue's blocks."""
        request_id = run.request.request_id
        if run.pending is not None:  # left before reading what the stream sent after the reply
            run.pending.cancel()
        if run.late_prefill is not None:
            await settle_prefill(run.late_prefill, run.finished, self.timeouts.abort_s)
        self._prefill_tokens.pop(request_id, None)
        placement = self._placements.get(request_id)
        if run.silent and placement is not None:  # its abort may wait out its deadline: the client hears now
            self.workers.in_background(self._abort_placement(request_id, placement))
        elif not run.finished:
            await self.abort(request_id)
        self._placements.pop(request_id, None)
        if placement is not None:
            total = len(run.request.prompt_token_ids) + run.generated
            self.admission.blocks_freed(prompt_blocks(total, placement.block_size))

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

    def _route_info(self, admitted: _Admitted, queue_s: float, fallback: str | None,
                    trace: BackendTrace) -> RouteInfo:
        d = admitted.decision
        prefill = None if fallback else d.prefill_id
        trace.route = RouteSummary(prefill, admitted.decode_id, d.reason, d.inputs, fallback)
        return RouteInfo(admitted.decode_id, prefill, d.reason, d.inputs, queue_s, fallback)

    async def _try_admit(self, request: BackendRequest, hashes: PromptHashes,
                         trace: BackendTrace | None = None) -> _Admitted | None:
        """One admission attempt on a fresh snapshot; None when no decode worker has room.
        `hashes`: the prompt's block hashes, kept across attempts; `trace` gets the successful
        attempt's reservation (its Decode call until the ticket)."""
        snapshot = self._with_own_load(await self._snapshot())
        route = self._route_request(hashes, request.params.max_tokens, snapshot)
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
            self._note_sent(request, hashes, route, admitted)
        return admitted

    def _note_sent(self, request: BackendRequest, hashes: PromptHashes, route: RouteRequest,
                   admitted: _Admitted) -> None:
        """Count the prefill this router just sent (until it returns) and expect both workers
        to cache the prompt, so the next requests see them before heartbeats and events do."""
        prefill_id = admitted.decision.prefill_id
        if prefill_id is not None:
            info = admitted.snapshot.by_id(prefill_id)
            cached = route.cached_for(prefill_id) * (info.block_size if info else 0)
            self._prefill_tokens[request.request_id] = (prefill_id, max(len(request.prompt_token_ids) - cached, 0))
        if self.kv_reader is not None:
            workers = [w for w in (prefill_id, admitted.decode_id) if w is not None]
            self.kv_reader.note_routed(workers, hashes, admitted.snapshot)

    def _with_own_load(self, snapshot: ClusterSnapshot) -> ClusterSnapshot:
        """The snapshot with each prefill worker's queue at least the prefill tokens this
        router has sent it and not seen back (heartbeats are up to an interval old)."""
        own: Counter[str] = Counter()
        for worker_id, tokens in self._prefill_tokens.values():
            own[worker_id] += tokens
        if not own:
            return snapshot
        workers = tuple(
            w.with_queued_prefill_tokens(max(w.queued_prefill_tokens, own[w.worker_id]))
            if own[w.worker_id] else w for w in snapshot.workers)
        return ClusterSnapshot(workers=workers, taken_at=snapshot.taken_at, stale=snapshot.stale)

    async def _admit(self, request: BackendRequest, snapshot: ClusterSnapshot, decision: RouteDecision,
                     local: bool) -> _Admitted | None:
        """Decode call on the chosen decode worker, then the others; None when all refuse."""
        candidates = [decision.decode_id] + [
            w.worker_id for w in snapshot.decode_workers() if w.worker_id != decision.decode_id]
        sampling = params_to_proto(request.params)  # once: the Prefill call sends it too
        for worker_id in candidates:
            info = snapshot.by_id(worker_id)
            if info is None:
                continue
            stream = self.workers.decode(info.address, info.link_address).Decode(worker_pb2.DecodeRequest(
                request_id=request.request_id, prompt_token_ids=list(request.prompt_token_ids),
                sampling=sampling, ticket_timeout_ms=self._ticket_timeout_ms,
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
                self.workers.in_background(self.workers.abort(info.address, request.request_id,
                                                              self.timeouts.abort_s, link_address=info.link_address))
                continue
            except BaseException:  # cancelled while waiting: the stream must not outlive us
                stream.cancel()
                raise
            if first is grpc.aio.EOF or not first.HasField("ticket"):
                stream.cancel()
                raise WorkerFailure(f"decode worker {worker_id} answered without a ticket")
            self._placements[request.request_id] = _Placement(info.address, info.block_size,
                                                              decode_link=info.link_address)
            return _Admitted(snapshot, decision, worker_id, stream, first.ticket, sampling)
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
                placement = self._placements[request.request_id]
                placement.prefill_address, placement.prefill_link = info.address, info.link_address
                sent_at = time.monotonic()
                try:
                    reply = await self.workers.prefill(info.address, info.link_address).Prefill(worker_pb2.PrefillRequest(
                        request_id=request.request_id, prompt_token_ids=list(request.prompt_token_ids),
                        sampling=admitted.sampling, ticket=ticket), timeout=self.timeouts.prefill_s)
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
        await self.workers.abort(placement.decode_address, request_id, self.timeouts.abort_s,
                                 link_address=placement.decode_link)
        if placement.prefill_address:
            await self.workers.abort(placement.prefill_address, request_id, self.timeouts.abort_s, prefill=True,
                                     link_address=placement.prefill_link)
