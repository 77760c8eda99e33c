"""TEST DOUBLES of the prefill and decode workers that answer at once — for
benchmarks/router_overhead.py only, never for serving.

They speak the real worker protos over real gRPC and over the worker link (proto/link, as real
workers serve both), and register in Redis with real heartbeats
(worker_runtime.heartbeat.HeartbeatPublisher + WorkerInfo), so the real router routes to them as to
real workers; but they compute nothing and hold no KV. What is left of a request's latency is
the router's own work (HTTP, validation, tokenization, routing, gRPC fan-out, detokenization,
SSE) plus gRPC and loopback costs, which the benchmark measures separately by calling the
doubles directly.

  InstantDecodeWorkerDouble.Decode: a Ticket at once, then the remaining max_tokens - 1 tokens
      (all of them when local_prefill), one TokenChunk per token, the last with
      finish_reason "length".
  InstantPrefillWorkerDouble.Prefill: the first token at once, no transfer.

Run as a process (what router_overhead.py does):
    python benchmarks/instant_workers.py --redis-url redis://127.0.0.1:PORT/0 --ready-file F
It writes "PREFILL_ADDRESS DECODE_ADDRESS PREFILL_LINK DECODE_LINK" to F once both serve and are
registered, and runs
until SIGINT/SIGTERM, then unregisters. Like real workers they need the cluster secret
($PDSERVE_CLUSTER_SECRET or _FILE) and refuse calls that do not prove it.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import signal
import sys
import time
import uuid
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere

from worker_runtime.heartbeat import HeartbeatPublisher  # noqa: E402
from proto.auth import load_cluster_secret  # noqa: E402
from proto.internal_auth import ClusterAuthServerInterceptor, require_cluster_secret  # noqa: E402
from proto.link import LinkServer  # noqa: E402
from proto.link import methods as link_methods  # noqa: E402
from proto.pdserve.v1 import worker_pb2, worker_pb2_grpc  # noqa: E402
from router.cluster.keys import WorkerInfo  # noqa: E402

BLOCK_SIZE = 16
TOTAL_BLOCKS = 1_000_000  # never the limit: the doubles admit everything
MAX_MODEL_LEN = 8192
FINISH_LENGTH = "length"


def decode_events(ticket: worker_pb2.Ticket, max_tokens: int, local_prefill: bool, token_id: int):
    """The events of one Decode call: the ticket, then one chunk per token (pure; tested)."""
    yield worker_pb2.DecodeEvent(ticket=ticket)
    count = max_tokens if local_prefill else max_tokens - 1  # the prefill worker gave the first
    if count <= 0:
        yield worker_pb2.DecodeEvent(tokens=worker_pb2.TokenChunk(finish_reason=FINISH_LENGTH, stop_token_id=-1))
        return
    for i in range(count):
        last = i == count - 1
        yield worker_pb2.DecodeEvent(tokens=worker_pb2.TokenChunk(
            token_ids=[token_id], finish_reason=FINISH_LENGTH if last else "", stop_token_id=-1))


class InstantDecodeWorkerDouble(worker_pb2_grpc.DecodeWorkerServicer):
    """A decode worker that admits everything and streams its tokens at once."""

    def __init__(self, worker_id: str, address: str, incarnation: str, token_id: int) -> None:
        self.worker_id, self.address, self.incarnation, self.token_id = worker_id, address, incarnation, token_id
        self._tickets = itertools.count(1)

    async def Decode(self, request, context):
        ticket = worker_pb2.Ticket(
            ticket_id=next(self._tickets), decode_worker_id=self.worker_id, decode_address=self.address,
            num_cached_tokens=0, num_blocks=-(-len(request.prompt_token_ids) // BLOCK_SIZE),
            incarnation=self.incarnation)
        max_tokens = request.sampling.max_tokens if request.sampling.HasField("max_tokens") else 16
        for event in decode_events(ticket, max_tokens, request.local_prefill, self.token_id):
            yield event

    async def OpenChannel(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "the instant double moves no KV")

    async def Abort(self, request, context):
        return worker_pb2.AbortResponse(aborted=False)

    async def GetLoad(self, request, context):
        return _load(self.worker_id, self.incarnation, "decode")


class InstantPrefillWorkerDouble(worker_pb2_grpc.PrefillWorkerServicer):
    """A prefill worker that returns the first token at once and sends no KV."""

    def __init__(self, worker_id: str, incarnation: str, token_id: int) -> None:
        self.worker_id, self.incarnation, self.token_id = worker_id, incarnation, token_id

    async def Prefill(self, request, context):
        return worker_pb2.PrefillResponse(
            first_token_id=self.token_id, num_cached_tokens=0,
            transfer=worker_pb2.TransferStats(bytes=0, seconds=0.0, num_blocks=0, backend="none"))

    async def Abort(self, request, context):
        return worker_pb2.AbortResponse(aborted=False)

    async def GetLoad(self, request, context):
        return _load(self.worker_id, self.incarnation, "prefill")


def _load(worker_id: str, incarnation: str, role: str) -> worker_pb2.LoadReport:
    return worker_pb2.LoadReport(worker_id=worker_id, incarnation=incarnation, role=role, block_size=BLOCK_SIZE,
                                 total_blocks=TOTAL_BLOCKS, free_blocks=TOTAL_BLOCKS)


def worker_info(worker_id: str, role: str, address: str, incarnation: str, link_address: str = "") -> WorkerInfo:
    return WorkerInfo(
        worker_id=worker_id, role=role, address=address, metrics_address="", incarnation=incarnation,
        block_size=BLOCK_SIZE, total_blocks=TOTAL_BLOCKS, free_blocks=TOTAL_BLOCKS, reserved_blocks=0,
        cached_blocks=0, num_running=0, num_waiting=0, queued_prefill_tokens=0, max_model_len=MAX_MODEL_LEN,
        updated_at=time.time(), link_address=link_address)


async def serve(args: argparse.Namespace) -> None:
    incarnation = uuid.uuid4().hex
    # They check the cluster secret as real workers do, so the router pays the same cost.
    secret = require_cluster_secret("instant workers")
    auth = [ClusterAuthServerInterceptor(secret)]
    prefill_server, decode_server = grpc.aio.server(interceptors=auth), grpc.aio.server(interceptors=auth)
    prefill_port = prefill_server.add_insecure_port("127.0.0.1:0")
    decode_port = decode_server.add_insecure_port("127.0.0.1:0")
    prefill_addr, decode_addr = f"127.0.0.1:{prefill_port}", f"127.0.0.1:{decode_port}"
    prefill = InstantPrefillWorkerDouble("instant-prefill-0", incarnation, args.token_id)
    decode = InstantDecodeWorkerDouble("instant-decode-0", decode_addr, incarnation, args.token_id)
    worker_pb2_grpc.add_PrefillWorkerServicer_to_server(prefill, prefill_server)
    worker_pb2_grpc.add_DecodeWorkerServicer_to_server(decode, decode_server)
    links = [LinkServer(secret, prefill, (link_methods.PREFILL, link_methods.ABORT), "127.0.0.1", 0),
             LinkServer(secret, decode, (link_methods.DECODE, link_methods.ABORT), "127.0.0.1", 0)]
    await prefill_server.start()
    await decode_server.start()
    prefill_link, decode_link = [f"127.0.0.1:{await link.start()}" for link in links]
    beats = [
        HeartbeatPublisher(args.redis_url, args.cluster,
                           lambda: worker_info("instant-prefill-0", "prefill", prefill_addr, incarnation, prefill_link),
                           secret=load_cluster_secret()),
        HeartbeatPublisher(args.redis_url, args.cluster,
                           lambda: worker_info("instant-decode-0", "decode", decode_addr, incarnation, decode_link),
                           secret=load_cluster_secret()),
    ]
    for beat in beats:
        beat.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if args.ready_file:
        Path(args.ready_file).write_text(f"{prefill_addr} {decode_addr} {prefill_link} {decode_link}\n")
    try:
        await stop.wait()
    finally:
        for beat in beats:
            beat.stop()
        await prefill_server.stop(grace=1)
        await decode_server.stop(grace=1)
        for link in links:
            await link.stop(1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--redis-url", required=True)
    p.add_argument("--cluster", default="default")
    p.add_argument("--token-id", type=int, default=260, help="the token every answer carries (260: ' the')")
    p.add_argument("--ready-file", default=None)
    args = p.parse_args(argv)
    try:
        import uvloop  # the event loop the HTTP twins (benchmarks/instant_http_workers.py) run on
        uvloop.run(serve(args))
    except ImportError:
        asyncio.run(serve(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
