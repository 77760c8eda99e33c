"""The banner `pdserve up` prints once its cluster serves (pdserve/launchers/local.py run_up),
driven through the real run_up with a stand-in for the cluster (no processes start)."""

from __future__ import annotations

import signal

import pytest

from pdserve.cli import build_parser
from pdserve.launchers.local import run_up


class StartedCluster:
    """The other side of run_up's seam: starts nothing, serves until wait() returns."""

    def __init__(self, args, signals) -> None:
        self.stopped = False

    def start(self) -> None:
        pass

    def describe(self) -> str:
        return "redis embedded; Ctrl-C drains and stops everything."

    def wait(self) -> int:
        return 0

    def stop(self) -> None:
        self.stopped = True


@pytest.fixture
def restore_signals():
    """run_up installs its SIGINT/SIGTERM handlers; give pytest's back afterwards."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def banner_of(capsys, *flags: str) -> list[str]:
    args = build_parser().parse_args(["up", *flags])
    assert run_up(args, StartedCluster) == 0
    return capsys.readouterr().out.splitlines()


def test_up_banner_prints_the_dashboard_url_beside_the_api(capsys, restore_signals):
    assert banner_of(capsys, "--port", "8123", "--grpc-port", "50999") == [
        "",
        "pdserve is up: OpenAI API http://127.0.0.1:8123/v1 , gRPC 127.0.0.1:50999",
        "  curl http://127.0.0.1:8123/v1/chat/completions -H 'Content-Type: application/json' "
        """-d '{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Hello!"}]}'""",
        "  dashboard: http://127.0.0.1:8123/dashboard",
        "  scale: pdserve scale prefill=2 decode=2 --url http://127.0.0.1:8123",
        "redis embedded; Ctrl-C drains and stops everything.",
        "",
    ]


@pytest.mark.parametrize(("host", "shown"), [("0.0.0.0", "127.0.0.1"), ("::", "127.0.0.1"),
                                             ("::1", "[::1]"), ("10.1.2.3", "10.1.2.3")])
def test_up_banner_on_a_wildcard_or_ipv6_bind_gives_urls_a_client_can_open(capsys, restore_signals, host, shown):
    lines = banner_of(capsys, "--host", host, "--port", "8000")
    assert lines[1] == f"pdserve is up: OpenAI API http://{shown}:8000/v1 , gRPC {shown}:50051"
    assert lines[3] == f"  dashboard: http://{shown}:8000/dashboard"


@pytest.mark.parametrize(("flags", "name"), [(("--served-model-name", "team-model"), "team-model"),
                                             (("--model", "/nowhere/llama-3-8b.Q4_K_M.gguf"), "llama-3-8b.Q4_K_M")])
def test_up_banner_curl_names_the_model_the_router_serves(capsys, restore_signals, flags, name):
    lines = banner_of(capsys, *flags)
    assert f'''-d '{{"model": "{name}", "messages"''' in lines[2]


@pytest.mark.parametrize(("env", "header"), [
    ({"PDSERVE_API_KEY": "s3cret-key"}, '-H "Authorization: Bearer $PDSERVE_API_KEY"'),
    ({"PDSERVE_API_KEY_FILE": "/run/keys/api"}, '-H "Authorization: Bearer $(cat "$PDSERVE_API_KEY_FILE")"'),
])
def test_up_banner_curl_carries_the_key_by_name_when_one_is_required(capsys, restore_signals, monkeypatch, env,
                                                                     header):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    curl = banner_of(capsys)[2]
    assert curl.startswith(f"  curl http://127.0.0.1:8000/v1/chat/completions {header} -H 'Content-Type")
    assert "s3cret-key" not in curl


def test_up_banner_curl_has_no_authorization_without_a_key(capsys, restore_signals, monkeypatch):
    for name in ("PDSERVE_API_KEY", "PDSERVE_API_KEY_FILE"):
        monkeypatch.delenv(name, raising=False)
    assert "Authorization" not in banner_of(capsys)[2]
