"""WorkerClient: one channel and one stub set per worker address, built once and reused by
every request (benchmarks/router_overhead.py measured the per-request stubs), closed together."""

import asyncio

from proto.pdserve.v1 import worker_pb2_grpc
from router.routing.worker_client import WorkerClient


def test_each_worker_address_gets_one_channel_and_one_stub_of_each_kind_reused_by_every_call():
    async def scenario():
        client = WorkerClient(secret=b"s" * 32)
        decode, prefill = client.decode("127.0.0.1:1"), client.prefill("127.0.0.1:1")
        assert isinstance(decode, worker_pb2_grpc.DecodeWorkerStub)
        assert isinstance(prefill, worker_pb2_grpc.PrefillWorkerStub)
        assert client.decode("127.0.0.1:1") is decode and client.prefill("127.0.0.1:1") is prefill
        assert client.decode("127.0.0.1:2") is not decode
        assert client.channel("127.0.0.1:1") is client.channel("127.0.0.1:1")
        channel = client.channel("127.0.0.1:1")
        await client.close()
        assert client.channel("127.0.0.1:1") is not channel  # closed ones are not handed out again
        assert client.decode("127.0.0.1:1") is not decode
        await client.close()

    asyncio.run(scenario())


def test_an_abort_to_a_worker_that_is_not_there_is_logged_not_raised(caplog):
    async def scenario():
        client = WorkerClient(secret=None)
        await client.abort("127.0.0.1:9", "req-1", timeout_s=0.5)
        await client.abort("127.0.0.1:9", "req-1", timeout_s=0.5, prefill=True)
        await client.close()

    with caplog.at_level("INFO", logger="router.routing.worker_client"):
        asyncio.run(scenario())
    assert [r.getMessage().split(" failed")[0] for r in caplog.records] == [
        "abort of req-1 on 127.0.0.1:9", "abort of req-1 on 127.0.0.1:9"]


def test_a_worker_with_a_link_gets_link_stubs_and_one_without_gets_grpc_stubs():
    from proto.link import LinkDecodeStub, LinkPrefillStub

    async def scenario():
        client = WorkerClient(secret=b"s" * 32)
        assert isinstance(client.decode("127.0.0.1:1", "127.0.0.1:2"), LinkDecodeStub)
        assert isinstance(client.prefill("127.0.0.1:1", "127.0.0.1:2"), LinkPrefillStub)
        assert client.decode("127.0.0.1:1", "127.0.0.1:2") is client.decode("127.0.0.1:1", "127.0.0.1:2")
        assert client.link("127.0.0.1:2") is client.link("127.0.0.1:2")  # one connection per worker
        assert isinstance(client.decode("127.0.0.1:1"), worker_pb2_grpc.DecodeWorkerStub)
        await client.close()

    asyncio.run(scenario())


def test_without_links_or_without_a_secret_every_call_goes_over_grpc():
    async def scenario():
        for client in (WorkerClient(secret=b"s" * 32, use_links=False), WorkerClient(secret=None)):
            assert not client.use_links
            assert isinstance(client.decode("127.0.0.1:1", "127.0.0.1:2"), worker_pb2_grpc.DecodeWorkerStub)
            assert isinstance(client.prefill("127.0.0.1:1", "127.0.0.1:2"), worker_pb2_grpc.PrefillWorkerStub)
            await client.close()

    asyncio.run(scenario())


def test_an_abort_over_a_link_to_a_worker_that_is_not_there_is_logged_not_raised(caplog):
    async def scenario():
        client = WorkerClient(secret=b"s" * 32)
        await client.abort("127.0.0.1:9", "req-2", timeout_s=0.5, link_address="127.0.0.1:9")
        await client.close()

    with caplog.at_level("INFO", logger="router.routing.worker_client"):
        asyncio.run(scenario())
    assert "abort of req-2 on 127.0.0.1:9 failed: UNAVAILABLE" in caplog.text
