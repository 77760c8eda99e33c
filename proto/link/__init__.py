"""The worker link: the router's request plane to its workers (Decode, Prefill, Abort) over one
multiplexed, authenticated TCP connection per router process and worker, as framed protobuf.

Why not gRPC here: in grpc.aio a call costs the caller ~0.8 ms of CPU (call setup, a poller
thread, a task per read), more than a Rust router spends on a whole request; these calls are
every request's path. The same calls over a framed connection cost ~0.08 ms
(benchmarks/router_overhead.py compares the two). gRPC stays for everything else a worker
serves (data-channel setup, load, drain, health, reflection) and for these calls too: the
router uses the link where a worker advertises one (its heartbeat's link_address), gRPC where
it does not or when started with --no-worker-link.

Both ends run the same servicers: the link server hands each call to the worker's gRPC servicer
method with a context whose abort() ends the call with that status, so a worker's behaviour
(refusals, no-room marks, aborts when the caller leaves) is one code path for both transports.

  frames.py     the wire format (header, kinds, status), the incremental frame reader
  handshake.py  mutual proof of the cluster secret when a connection opens
  methods.py    the calls the link carries, by id
  server.py     LinkServer: accepts, authenticates, runs calls on a servicer
  client.py     LinkChannel: one connection, calls shaped as grpc.aio's (read(), cancel(),
                AioRpcError), so the router's call sites serve both transports unchanged
  calls.py      a call's state on the caller's side (responses not read yet, its end)
  coalesce.py   the frames of one event-loop pass leave in one send
"""

from proto.link.calls import LinkRpcError
from proto.link.client import LinkChannel, LinkDecodeStub, LinkPrefillStub
from proto.link.server import LinkServer

__all__ = ["LinkChannel", "LinkDecodeStub", "LinkPrefillStub", "LinkRpcError", "LinkServer"]
