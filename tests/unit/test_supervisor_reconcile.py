"""The supervisor's reconcile step with a fake clock and fake processes (the other side of
its seam): which worker starts, which drains, when a crashed one restarts."""

from __future__ import annotations

from pdserve.launchers.supervisor import KILL_GRACE_S, Supervisor, restart_delay
from pdserve.specs import WorkerSpec


class FakeProcess:
    next_pid = 100

    def __init__(self, spec: WorkerSpec) -> None:
        FakeProcess.next_pid += 1
        self.pid, self.spec = FakeProcess.next_pid, spec
        self.where = f"pid {self.pid}"
        self.code: int | None = None
        self.ready = False
        self.signals: list[str] = []

    def poll(self):
        return self.code

    def is_ready(self) -> bool:
        return self.ready

    def terminate(self) -> None:
        self.signals.append("TERM")

    def kill(self) -> None:
        self.signals.append("KILL")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def supervisor() -> tuple[Supervisor, list[FakeProcess], Clock]:
    launched: list[FakeProcess] = []
    clock = Clock()

    def launch(spec: WorkerSpec) -> FakeProcess:
        launched.append(FakeProcess(spec))
        return launched[-1]

    sup = Supervisor(lambda role, wid: WorkerSpec(role=role, worker_id=wid, drain_timeout_s=10), launch, clock)
    return sup, launched, clock


def ids(sup: Supervisor) -> list[tuple[str, str]]:
    return [(s.worker_id, s.state) for s in sup.slots]


def test_backoff_doubles_from_one_second_to_thirty():
    assert [restart_delay(n) for n in range(1, 8)] == [1, 2, 4, 8, 16, 30, 30]


def test_scale_up_starts_the_lowest_free_ids_and_they_turn_ready():
    sup, launched, _ = supervisor()
    sup.step({"decode": 2, "prefill": 1})
    assert [p.spec.worker_id for p in launched] == ["decode-0", "decode-1", "prefill-0"]
    launched[1].ready = True
    sup.step({"decode": 2, "prefill": 1})
    assert ids(sup) == [("decode-0", "starting"), ("decode-1", "ready"), ("prefill-0", "starting")]
    assert sup.counts()["decode"] == {"ready": 1, "starting": 1, "draining": 0}


def test_scale_down_drains_the_newest_and_forgets_it_once_it_exits():
    sup, launched, _ = supervisor()
    sup.step({"decode": 1})
    launched[0].ready = True
    sup.step({"decode": 3})
    for p in launched:
        p.ready = True
    sup.step({"decode": 1})
    assert ids(sup) == [("decode-0", "ready"), ("decode-1", "draining"), ("decode-2", "draining")]
    assert [p.signals for p in launched] == [[], ["TERM"], ["TERM"]]
    launched[2].code = 0
    sup.step({"decode": 1})
    assert ids(sup) == [("decode-0", "ready"), ("decode-1", "draining")]
    assert sup.restarts == {"prefill": 0, "decode": 0}
    sup.step({"decode": 2})  # decode-1 still drains: a new id, not a second decode-1
    assert ids(sup)[-1] == ("decode-2", "starting")


def test_a_starting_worker_is_removed_before_a_ready_one():
    sup, launched, _ = supervisor()
    sup.step({"decode": 2})
    launched[1].ready = True
    sup.step({"decode": 1})
    assert ids(sup) == [("decode-0", "draining"), ("decode-1", "ready")]


def test_a_crashed_worker_restarts_under_its_id_after_the_backoff_and_is_counted():
    sup, launched, clock = supervisor()
    sup.step({"decode": 1})
    launched[0].ready = True
    sup.step({"decode": 1})
    launched[0].code = -9
    sup.step({"decode": 1})
    assert (ids(sup), sup.restarts["decode"]) == ([("decode-0", "backoff")], 1)
    clock.now += 0.9
    sup.step({"decode": 1})
    assert len(launched) == 1
    clock.now += 0.2
    sup.step({"decode": 1})
    assert [p.spec.worker_id for p in launched] == ["decode-0", "decode-0"]
    launched[1].code = 1  # crashes again at once: 2 s
    sup.step({"decode": 1})
    assert sup.slots[0].restart_at == clock.now + 2


def test_backoff_resets_after_a_minute_up():
    sup, launched, clock = supervisor()
    sup.step({"decode": 1})
    launched[0].code = 1
    sup.step({"decode": 1})
    clock.now += 1
    sup.step({"decode": 1})
    launched[1].ready = True
    clock.now += 61
    sup.step({"decode": 1})
    assert sup.slots[0].failures == 0
    launched[1].code = 1
    sup.step({"decode": 1})
    assert (sup.slots[0].restart_at, sup.restarts["decode"]) == (clock.now + 1, 2)


def test_a_worker_waiting_to_restart_that_is_no_longer_wanted_is_dropped():
    sup, launched, _ = supervisor()
    sup.step({"decode": 1})
    launched[0].code = 1
    sup.step({"decode": 0})
    assert ids(sup) == []


def test_a_draining_worker_past_its_drain_timeout_and_grace_is_killed():
    sup, launched, clock = supervisor()
    sup.step({"decode": 1})
    sup.step({"decode": 0})
    clock.now += 10 + KILL_GRACE_S + 1
    sup.step({"decode": 0})
    assert launched[0].signals == ["TERM", "KILL"]
