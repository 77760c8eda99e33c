"""Authentication of the internal gRPC services (DecodeWorker, PrefillWorker) by the cluster secret.

Every call carries one metadata entry, `x-pdserve-cluster-auth: v1 <unix ms> <nonce> <hmac>`,
where hmac = HMAC-SHA256(secret, "grpc", method, ms, nonce) (proto.auth.sign). Why a per-call
proof rather than the secret itself: internal links are plain TCP unless mTLS is set up, and a
proof names one method at one moment, so a captured one neither reveals the secret nor opens
another method, and it stops working after MAX_SKEW_S. (Within that window a captured proof can be
replayed for the same method; whoever can capture it can also read the prompts on that link.)

The worker checks the proof in a server interceptor (constant-time compare) before any handler
runs, and answers UNAUTHENTICATED otherwise; nothing is reserved or computed for a caller that
failed. The health and reflection services stay open: probes carry no secret, and neither
service touches request data.

Callers open their channels with `internal_channel`, which adds the proof to every call, so stubs
and call sites stay as they were. It wraps each method's callable rather than using grpc.aio
client interceptors: an intercepted call costs an extra task and a wrapped response iterator,
a measurable share of the router's CPU per request (benchmarks/router_overhead.py).
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Sequence

import grpc

from proto.auth import CLUSTER_SECRET_ENV, CLUSTER_SECRET_FILE_ENV, load_cluster_secret, sign, verify

__all__ = [
    "AUTH_METADATA_KEY",
    "MAX_SKEW_S",
    "OPEN_SERVICES",
    "ClusterAuthServerInterceptor",
    "auth_metadata",
    "check_proof",
    "client_interceptors",
    "internal_channel",
    "make_proof",
    "require_cluster_secret",
]

logger = logging.getLogger(__name__)

AUTH_METADATA_KEY = "x-pdserve-cluster-auth"
"""The metadata key (gRPC metadata keys are lowercase) carrying the per-call proof."""
MAX_SKEW_S = 300.0
"""How far a proof's timestamp may be from the worker's clock (hosts' clocks differ a little)."""
OPEN_SERVICES = ("/grpc.health.v1.Health/", "/grpc.reflection.v1alpha.ServerReflection/",
                 "/grpc.reflection.v1.ServerReflection/")
"""Method prefixes answered without a proof: health probes and reflection (no request data)."""
_VERSION = "v1"


def require_cluster_secret(program: str) -> bytes:
    """The cluster secret, or SystemExit with one line naming the variables (no traceback):
    every port a worker or router opens authenticates its callers, so none starts without it."""
    try:
        secret = load_cluster_secret()
    except ValueError as exc:
        raise SystemExit(f"{program}: {exc}") from None
    if secret is None:
        raise SystemExit(
            f"{program}: no cluster secret: set {CLUSTER_SECRET_ENV} (the secret) or "
            f"{CLUSTER_SECRET_FILE_ENV} (a file holding it) in the environment; every router and "
            "worker of a cluster needs the same one (pdserve up generates it for its children)")
    return secret


def make_proof(secret: bytes, method: str, now: float | None = None) -> str:
    """The metadata value proving knowledge of `secret` for one call of `method`
    ("/pdserve.v1.DecodeWorker/Decode")."""
    millis = str(int((time.time() if now is None else now) * 1000))
    nonce = secrets.token_hex(8)
    return f"{_VERSION} {millis} {nonce} {sign(secret, 'grpc', method, millis, nonce)}"


def auth_metadata(secret: bytes, method: str) -> tuple[tuple[str, str], ...]:
    """Call metadata for one call of `method` (for callers that pass metadata= by hand)."""
    return ((AUTH_METADATA_KEY, make_proof(secret, method)),)


def check_proof(secret: bytes, method: str, value: str | None, now: float | None = None) -> str | None:
    """None when `value` proves the secret for `method` now; else why not (no secret in it)."""
    if not value:
        return f"missing {AUTH_METADATA_KEY} metadata (the cluster secret's proof)"
    parts = value.split(" ")
    if len(parts) != 4 or parts[0] != _VERSION or not parts[1].isdigit():
        return f"malformed {AUTH_METADATA_KEY} metadata"
    _, millis, nonce, mac = parts
    skew = abs((time.time() if now is None else now) - int(millis) / 1000)
    if not verify(secret, mac, "grpc", method, millis, nonce):
        return "the cluster secret's proof does not verify (wrong secret?)"
    if skew > MAX_SKEW_S:
        return f"the proof is {skew:.0f}s away from this worker's clock (limit {MAX_SKEW_S:.0f}s)"
    return None


class ClusterAuthServerInterceptor(grpc.aio.ServerInterceptor):
    """Refuses, with UNAUTHENTICATED, every call outside OPEN_SERVICES that lacks a valid proof."""

    def __init__(self, secret: bytes, open_services: Sequence[str] = OPEN_SERVICES,
                 clock: Callable[[], float] = time.time) -> None:
        if not secret:
            raise ValueError("the cluster secret is empty")
        self._secret = secret
        self._open = tuple(open_services)
        self._clock = clock
        self.refused = 0
        """Calls refused so far (a count for tests and logs)."""
        self._last_log = 0.0

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        if method.startswith(self._open):
            return await continuation(handler_call_details)
        value = next((v for k, v in handler_call_details.invocation_metadata or ()
                      if k == AUTH_METADATA_KEY), None)
        if isinstance(value, bytes):
            value = value.decode(errors="replace")
        reason = check_proof(self._secret, method, value, self._clock())
        handler = await continuation(handler_call_details)
        if reason is None:
            return handler
        self._log_refusal(method, reason)
        return _refusal(handler, f"{method}: {reason}")

    def _log_refusal(self, method: str, reason: str) -> None:
        """Logged at most every 10 s, so a flood of bad calls cannot flood the log."""
        self.refused += 1
        now = time.monotonic()
        if now - self._last_log >= 10.0:
            self._last_log = now
            logger.warning("refused an internal gRPC call to %s: %s (%d refused so far)",
                           method, reason, self.refused)


def _refusal(handler: grpc.RpcMethodHandler | None, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that aborts with UNAUTHENTICATED."""

    async def deny(request_or_iterator, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    if handler is None or not (handler.request_streaming or handler.response_streaming):
        return grpc.unary_unary_rpc_method_handler(deny)
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(deny)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(deny)
    return grpc.unary_stream_rpc_method_handler(deny)


class _AddProof:
    """Adds the proof for the call's method to its metadata (shared by the four call shapes)."""

    def __init__(self, secret: bytes) -> None:
        if not secret:
            raise ValueError("the cluster secret is empty")
        self._secret = secret

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        method = details.method.decode() if isinstance(details.method, bytes) else details.method
        metadata = grpc.aio.Metadata(*(details.metadata or ()))
        metadata.add(AUTH_METADATA_KEY, make_proof(self._secret, method))
        return grpc.aio.ClientCallDetails(details.method, details.timeout, metadata,
                                          details.credentials, details.wait_for_ready)


class _UnaryUnary(_AddProof, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(self._details(details), request)


class _UnaryStream(_AddProof, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(self._details(details), request)


class _StreamUnary(_AddProof, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, details, request_iterator):
        return await continuation(self._details(details), request_iterator)


class _StreamStream(_AddProof, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, details, request_iterator):
        return await continuation(self._details(details), request_iterator)


def client_interceptors(secret: bytes) -> list[grpc.aio.ClientInterceptor]:
    """One interceptor per call shape (a channel files each interceptor under one shape only)."""
    return [cls(secret) for cls in (_UnaryUnary, _UnaryStream, _StreamUnary, _StreamStream)]


class _ProvingCallable:
    """One method's callable whose every call carries the proof for that method."""

    __slots__ = ("_call", "_method", "_secret")

    def __init__(self, call, method: str | bytes, secret: bytes) -> None:
        self._call, self._secret = call, secret
        self._method = method.decode() if isinstance(method, bytes) else method

    def __call__(self, request, *, metadata=None, **kwargs):
        proof = (AUTH_METADATA_KEY, make_proof(self._secret, self._method))
        return self._call(request, metadata=(*(metadata or ()), proof), **kwargs)


class ProvingChannel(grpc.aio.Channel):
    """A grpc.aio channel whose every call proves the cluster secret (see the module docstring)."""

    def __init__(self, channel: grpc.aio.Channel, secret: bytes) -> None:
        if not secret:
            raise ValueError("the cluster secret is empty")
        self._channel, self._secret = channel, secret

    def unary_unary(self, method, *args, **kwargs):
        return _ProvingCallable(self._channel.unary_unary(method, *args, **kwargs), method, self._secret)

    def unary_stream(self, method, *args, **kwargs):
        return _ProvingCallable(self._channel.unary_stream(method, *args, **kwargs), method, self._secret)

    def stream_unary(self, method, *args, **kwargs):
        return _ProvingCallable(self._channel.stream_unary(method, *args, **kwargs), method, self._secret)

    def stream_stream(self, method, *args, **kwargs):
        return _ProvingCallable(self._channel.stream_stream(method, *args, **kwargs), method, self._secret)

    async def __aenter__(self):
        return self

    async def __aexit__(self, exc_type, exc_val, exc_tb):
        await self._channel.close()

    async def close(self, grace: float | None = None):
        await self._channel.close(grace)

    def get_state(self, try_to_connect: bool = False):
        return self._channel.get_state(try_to_connect)

    async def wait_for_state_change(self, last_observed_state):
        return await self._channel.wait_for_state_change(last_observed_state)

    async def channel_ready(self):
        return await self._channel.channel_ready()


def internal_channel(address: str, secret: bytes, options=None) -> grpc.aio.Channel:
    """An aio channel to a worker whose every call proves the cluster secret."""
    return ProvingChannel(grpc.aio.insecure_channel(address, options=options), secret)
