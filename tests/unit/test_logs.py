"""Log lines of every pdserve process: text names the process, JSON lines carry worker_id, role
and the request id; the logging flags reach the children through their specs."""

from __future__ import annotations

import json
import logging

import pytest

from pdserve.cli import build_parser
from pdserve.logs import configure_logging
from pdserve.specs import RouterSpec, WorkerSpec
from proto.log_context import request_context, set_identity, set_request_id

TS = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}"


@pytest.fixture(autouse=True)
def restore_logging():
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for handler in list(root.handlers):
        root.removeHandler(handler)
    for handler in handlers:
        root.addHandler(handler)
    root.setLevel(level)
    set_identity(None)


def test_json_lines_carry_worker_role_logger_and_the_request_id(capsys):
    configure_logging("INFO", "json", "decode", "decode-0")
    log = logging.getLogger("decode_worker.worker")
    with request_context("req-7"):
        log.info("admitted %d tokens", 40)
    log.warning("no request here")
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    assert [set(line) for line in lines] == [
        {"ts", "level", "logger", "message", "worker_id", "role", "request_id"},
        {"ts", "level", "logger", "message", "worker_id", "role"},
    ]
    assert [(l["level"], l["logger"], l["message"], l["worker_id"], l["role"], l.get("request_id")) for l in lines] == [
        ("INFO", "decode_worker.worker", "admitted 40 tokens", "decode-0", "decode", "req-7"),
        ("WARNING", "decode_worker.worker", "no request here", "decode-0", "decode", None),
    ]
    assert lines[0]["ts"].endswith("+00:00")


def test_a_stats_line_in_json_carries_its_numbers():
    import io

    configure_logging("INFO", "json", "router")
    stream = io.StringIO()
    logging.getLogger().handlers[0].setStream(stream)
    logging.getLogger("router.serving.stats_log").info("Cluster: x", extra={"stats": {"running": 2}})
    line = json.loads(stream.getvalue())
    assert (line["message"], line["stats"], line["role"], line["worker_id"]) == ("Cluster: x", {"running": 2},
                                                                                 "router", None)


def test_text_lines_name_the_worker_and_a_later_identity_replaces_the_role(capsys):
    import re

    configure_logging("INFO", "text", "decode")
    logging.getLogger("pdserve.worker_main").info("loading")
    set_identity("decode", "decode-3")  # what WorkerProcess does once its generated id is known
    logging.getLogger("worker_runtime.process").info("serving")
    err = capsys.readouterr().err.splitlines()
    assert re.fullmatch(TS + r" INFO \[decode\] pdserve.worker_main: loading", err[0])
    assert re.fullmatch(TS + r" INFO \[decode-3\] worker_runtime.process: serving", err[1])


def test_a_command_that_is_no_component_logs_the_classic_line(capsys):
    import re

    configure_logging("INFO", "text")
    logging.getLogger("engine.llm").info("ready")
    assert re.fullmatch(TS + r" INFO engine.llm: ready", capsys.readouterr().err.strip())


def test_the_request_id_of_one_task_does_not_leak_into_another():
    import asyncio

    from proto.log_context import current_request_id

    async def handle(request_id: str) -> str | None:
        set_request_id(request_id)
        await asyncio.sleep(0.01)
        return current_request_id()

    async def main():
        return await asyncio.gather(handle("a"), handle("b")), current_request_id()

    assert asyncio.run(main()) == (["a", "b"], None)


def test_unknown_log_format_is_refused_by_the_flag_and_the_spec(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["decode", "--log-format", "xml"])
    assert "invalid choice: 'xml' (choose from 'text', 'json')" in capsys.readouterr().err
    with pytest.raises(ValueError) as info:
        WorkerSpec(role="decode", log_format="xml")  # type: ignore[arg-type]
    assert str(info.value) == "log_format must be one of text, json; got 'xml'"
    with pytest.raises(ValueError) as info:
        RouterSpec(log_stats_interval_s=-1.0)
    assert str(info.value) == "log_stats_interval_s must be >= 0 (0: no stats lines); got -1.0"


def test_logging_settings_round_trip_through_worker_and_router_argv():
    parser = build_parser()
    worker = WorkerSpec(role="prefill", worker_id="prefill-1", log_format="json", log_stats_interval_s=2.5)
    assert WorkerSpec.from_args(parser.parse_args(worker.to_argv())) == worker
    router = RouterSpec(log_format="json", log_stats_interval_s=0.0)
    assert RouterSpec.from_args(parser.parse_args(router.to_argv())) == router


def test_default_logging_settings_are_left_out_of_a_childs_argv():
    for argv in (WorkerSpec(role="decode").to_argv(), RouterSpec().to_argv()):
        assert "--log-format" not in argv and "--log-stats-interval" not in argv
    assert WorkerSpec.from_args(build_parser().parse_args(["decode"])).log_stats_interval_s == 10.0


def test_up_passes_its_logging_flags_to_its_workers_and_router():
    from pdserve.launchers.local import LocalCluster

    args = build_parser().parse_args(["up", "--log-format", "json", "--log-stats-interval", "3"])
    cluster = LocalCluster(args)
    try:
        worker = cluster._worker_spec("decode", "decode-0")  # noqa: SLF001 — the spec it launches
    finally:
        cluster.workdir.rmdir()
    assert (worker.log_format, worker.log_stats_interval_s) == ("json", 3.0)
    router = RouterSpec.from_args(args)  # what start_router builds on
    assert (router.log_format, router.log_stats_interval_s) == ("json", 3.0)
