"""A client's X-Request-Id is echoed, never a key: reusing one cannot touch another request."""

from __future__ import annotations

import asyncio

import httpx

from tests.unit.router_doubles import make_app, sse_payloads, token_steps

PARIS = [7042, 314, 9239, 30, 378, 1112]  # " Paris", " is", " nice", ".", " The", " end"
SAME = {"x-request-id": "dup"}


def test_two_concurrent_streams_with_the_same_request_id_both_finish_in_full():
    app, backend = make_app(token_steps(PARIS), hold_after=2)

    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
            body = {"prompt": "Hello", "max_tokens": 6, "stream": True}
            first = asyncio.create_task(client.post("/v1/completions", json=body, headers=SAME))
            second = asyncio.create_task(client.post("/v1/completions", json=body, headers=SAME))
            for _ in range(200):  # both held mid-stream (bounded: 2 s)
                if len(backend.requests) == 2:
                    break
                await asyncio.sleep(0.01)
            backend.release.set()
            return await first, await second

    responses = asyncio.run(go())
    for response in responses:
        assert response.headers["x-request-id"] == "dup"
        chunks = [p for p in sse_payloads(response.text) if p != "[DONE]"]
        assert "".join(c["choices"][0]["text"] for c in chunks) == " Paris is nice. The end"
        assert chunks[0]["id"] == "cmpl-dup"
    assert sorted(r.request_id for r in backend.requests) == ["b1-0", "b2-0"]
    assert backend.aborted == []
