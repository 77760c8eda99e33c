"""GET /v1/plan on the real FastAPI app: the contract's shape with exact numbers, the API key
like every /v1 route, and --autoscale refused without a scaler."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from router.api.http import HttpSettings, create_app
from router.ops.planner.http import plan_routes
from tests.unit.roles_doubles import FakeScaler
from tests.unit.router_doubles import ScriptedBackend, call, make_service, token_steps
from tests.unit.test_autoscale import planner

ROOT = Path(__file__).resolve().parents[2]


def app(api_key: str | None = None, autoscale: bool = False):
    settings = HttpSettings(api_key=api_key, ops_routes=(plan_routes(planner(FakeScaler({"prefill": 1, "decode": 1}),
                                                                             autoscale)),))
    return create_app(make_service(ScriptedBackend(token_steps([1]))), settings)


def test_plan_answers_the_recommendation_with_its_arithmetic_and_inputs():
    response = call(app(), "GET", "/v1/plan")
    assert response.status_code == 200
    body = response.json()
    assert {k: body[k] for k in ("current", "recommended", "reasons", "slo", "window_s", "autoscale")} == {
        "current": {"prefill": 1, "decode": 1},
        "recommended": {"prefill": 3, "decode": 1},
        "reasons": {"prefill": "1000.0 prompt tok/s over 400.0 tok/s per worker",
                    "decode": "2.0 output tok/s over 160.0 tok/s per worker"},
        "slo": {"ttft_ms": None, "itl_ms": None},
        "window_s": 60,
        "autoscale": {"enabled": False, "min": {"prefill": 1, "decode": 1}, "max": {"prefill": 4, "decode": 4},
                      "last_action": None},
    }
    assert body["arithmetic"][2] == "prefill: ceil(1000.0 / 400.0) = 3 prefill workers"
    assert body["inputs"]["prompt_tokens_per_s"] == 1000.0
    assert body["inputs"]["prefill_tokens_per_busy_s"] == 500.0
    assert "ttft_p99_ms" not in body["inputs"]  # nothing observed: left out, every value is a number


def test_plan_needs_the_api_key_when_one_is_set():
    application = app(api_key="sk-plan")
    assert call(application, "GET", "/v1/plan").status_code == 401
    assert call(application, "GET", "/v1/plan", headers={"Authorization": "Bearer sk-plan"}).status_code == 200


def test_autoscale_without_a_scaler_is_refused_at_start_with_one_line():
    result = subprocess.run([sys.executable, "-m", "pdserve", "router", "--autoscale", "--port", "0", "--grpc-port", "0"],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        "pdserve router: --autoscale needs a scaler to act through (--scaler local, ray or kubernetes; "
        "pdserve up and the Helm chart set one)"]
