"""internal_channel's calls carry a valid proof for their own method, after the caller's own
metadata, without grpc.aio client interceptors (router_overhead: one task less per call)."""

from __future__ import annotations

import asyncio

from proto.internal_auth import AUTH_METADATA_KEY, ProvingChannel, check_proof, internal_channel

SECRET = b"s" * 32


class _Inner:
    """The other side of the seam: records what each method's callable was called with."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, object, tuple, dict]] = []

    def unary_stream(self, method, *args, **kwargs):
        def call(request, *, metadata=None, **kw):
            self.calls.append((method, request, tuple(metadata), kw))
            return "call-object"
        return call


def test_each_call_carries_a_proof_for_its_method_after_the_callers_metadata():
    inner = _Inner()
    channel = ProvingChannel(inner, SECRET)  # type: ignore[arg-type]
    decode = channel.unary_stream("/pdserve.v1.DecodeWorker/Decode", request_serializer=None)
    assert decode("req", metadata=(("x-request-id", "r1"),), timeout=5) == "call-object"
    [(method, request, metadata, kwargs)] = inner.calls
    assert (method, request, kwargs) == ("/pdserve.v1.DecodeWorker/Decode", "req", {"timeout": 5})
    assert metadata[0] == ("x-request-id", "r1")
    key, proof = metadata[1]
    assert key == AUTH_METADATA_KEY
    assert check_proof(SECRET, "/pdserve.v1.DecodeWorker/Decode", proof) is None
    assert check_proof(SECRET, "/pdserve.v1.PrefillWorker/Prefill", proof) is not None


def test_internal_channel_uses_no_client_interceptors():
    async def go():
        async with internal_channel("127.0.0.1:1", SECRET) as channel:
            assert isinstance(channel, ProvingChannel)
            assert not getattr(channel._channel, "_unary_stream_interceptors", None)

    asyncio.run(go())
