"""ServingLoop.deliver: a sink that raises fails only its own request, never the loop."""

from __future__ import annotations

from engine.scheduler import EngineCoreOutput
from engine.serving_loop import ServingLoop


class _Core:
    def __init__(self) -> None:
        self.aborted: list[str] = []

    def stats(self):
        return None

    def abort(self, ids):
        self.aborted.extend(ids)
        return []


def _out(request_id: str, token: int) -> EngineCoreOutput:
    return EngineCoreOutput(request_id, (token,), None, None, None)


def test_a_raising_sink_aborts_its_request_and_the_next_outputs_are_still_delivered():
    core = _Core()
    loop = ServingLoop(core)  # never started: deliver is called directly, as the loop thread would
    got: list[tuple[str, int]] = []

    def broken(output):
        raise KeyError("holds no finished blocks")

    loop.attach("bad", broken)
    loop.attach("good", lambda o: got.append((o.request_id, o.new_token_ids[0])))
    for output in (_out("bad", 1), _out("good", 2), _out("bad", 3), _out("good", 4)):
        loop.deliver(output)
    assert got == [("good", 2), ("good", 4)]
    assert core.aborted == ["bad"]
