"""ChannelOpenings (prefill_worker/openings.py): lanes per decode worker taken in turn, each
opened once for all concurrent callers, and forgotten one by one (a closed channel) or all
together (a failed transfer)."""

from __future__ import annotations

import asyncio

import pytest

from kv_transfer.base import ChannelAddress
from prefill_worker.openings import ChannelOpenings


class Opener:
    """Opens channel n for the n-th call (an RPC to the decode worker in the real worker)."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    async def __call__(self, decode_address: str) -> ChannelAddress:
        self.calls.append(decode_address)
        n = len(self.calls)
        await asyncio.sleep(0)
        return ChannelAddress("127.0.0.1", 7000 + n, f"ch{n}")


def _ports(addresses) -> list[int]:
    return [a.port for a in addresses]


def test_successive_requests_take_the_lanes_in_turn_and_each_lane_opens_once():
    async def run():
        opener = Opener()
        openings = ChannelOpenings(opener, lanes=3)
        got = await asyncio.gather(*(openings.get("d1:1", "inc") for _ in range(4)))
        more = [await openings.get("d1:1", "inc") for _ in range(2)]
        return opener.calls, got + more

    calls, got = asyncio.run(run())
    assert calls == ["d1:1"] * 3
    assert _ports(got) == [7001, 7002, 7003, 7001, 7002, 7003]


def test_a_closed_channel_reopens_only_its_own_lane_and_a_failed_transfer_reopens_every_lane():
    async def run():
        opener = Opener()
        openings = ChannelOpenings(opener, lanes=2)
        first = [await openings.get("d1:1", "inc") for _ in range(2)]
        openings.forget_address(first[0])
        after_close = [await openings.get("d1:1", "inc") for _ in range(2)]
        openings.forget(("d1:1", "inc"))
        after_failure = [await openings.get("d1:1", "inc") for _ in range(2)]
        return first, after_close, after_failure

    first, after_close, after_failure = asyncio.run(run())
    assert (_ports(first), _ports(after_close), _ports(after_failure)) == ([7001, 7002], [7003, 7002], [7004, 7005])


def test_lanes_below_one_are_refused():
    with pytest.raises(ValueError, match="lanes must be at least 1, got 0"):
        ChannelOpenings(Opener(), lanes=0)
