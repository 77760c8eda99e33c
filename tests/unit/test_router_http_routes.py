"""The non-generating routes (/v1/models, /health, /version, /tokenize, /detokenize, /metrics)
and the API key."""

from __future__ import annotations

from tests.unit.router_doubles import (
    CREATED,
    MODEL,
    MODEL_ROOT,
    call,
    make_app,
    token_steps,
)
from tests.unit.test_router_validation import HI_PROMPT_IDS

KEY = "sk-test-123"
LABELS = f'model_name="{MODEL}",role="router"'


def test_models_lists_the_served_model():
    app, _ = make_app([])
    assert call(app, "GET", "/v1/models").json() == {
        "object": "list",
        "data": [
            {
                "id": MODEL,
                "object": "model",
                "created": CREATED,
                "owned_by": "pdserve",
                "root": MODEL_ROOT,
                "parent": None,
                "max_model_len": 2048,
                "permission": [],
            }
        ],
    }


def test_health_is_200_with_an_empty_body_and_version_reports_the_version():
    app, _ = make_app([])
    health = call(app, "GET", "/health")
    assert (health.status_code, health.content) == (200, b"")
    assert call(app, "GET", "/version").json() == {"version": "9.9.9"}


def test_tokenize_a_prompt():
    app, _ = make_app([])
    response = call(app, "POST", "/tokenize", json={"model": MODEL, "prompt": "Hello world"})
    assert response.json() == {
        "count": 2,
        "max_model_len": 2048,
        "tokens": [19556, 905],
        "token_strs": None,
    }


def test_tokenize_messages_applies_the_chat_template_and_can_spell_tokens():
    app, _ = make_app([])
    body = {"messages": [{"role": "user", "content": "Hi"}], "return_token_strs": True}
    response = call(app, "POST", "/tokenize", json=body).json()
    assert response["tokens"] == list(HI_PROMPT_IDS)
    assert response["count"] == 31
    assert response["token_strs"][-4:] == ["<|im_start|>", "ass", "istant", "Ċ"]


def test_detokenize_keeps_special_tokens():
    app, _ = make_app([])
    response = call(app, "POST", "/detokenize", json={"tokens": [1, 26843, 2]})
    assert response.json() == {"prompt": "<|im_start|>Hi<|im_end|>"}


def test_detokenize_out_of_vocabulary_is_a_400():
    app, _ = make_app([])
    response = call(app, "POST", "/detokenize", json={"tokens": [49152]})
    assert response.status_code == 400
    assert response.json()["error"]["message"] == "Token id 49152 is out of vocabulary"


def test_metrics_count_finished_requests_with_the_router_role():
    app, _ = make_app(token_steps([7042, 314]))
    call(app, "POST", "/v1/completions", json={"prompt": "Hello", "max_tokens": 2})
    response = call(app, "GET", "/metrics")
    assert response.headers["content-type"].startswith("text/plain; version=")
    lines = set(response.text.splitlines())
    assert f'vllm:request_success_total{{finished_reason="length",{LABELS}}} 1.0' in lines
    assert f"vllm:prompt_tokens_total{{{LABELS}}} 1.0" in lines
    assert f"vllm:generation_tokens_total{{{LABELS}}} 2.0" in lines
    assert f"vllm:time_to_first_token_seconds_count{{{LABELS}}} 1.0" in lines
    assert f"vllm:inter_token_latency_seconds_count{{{LABELS}}} 1.0" in lines
    assert f"vllm:e2e_request_latency_seconds_count{{{LABELS}}} 1.0" in lines
    path_labels = f'model_name="{MODEL}",path="disaggregated",role="router"'
    assert f"pdserve_request_path_total{{{path_labels}}} 1.0" in lines


def test_each_app_has_its_own_metrics_registry():
    first, _ = make_app(token_steps([7042]))
    second, _ = make_app(token_steps([7042]))
    call(first, "POST", "/v1/completions", json={"prompt": "Hello"})
    lines = set(call(second, "GET", "/metrics").text.splitlines())
    assert f'vllm:request_success_total{{finished_reason="length",{LABELS}}} 1.0' not in lines


def test_api_key_is_required_on_every_route_but_health():
    app, _ = make_app(token_steps([7042]), api_key=KEY)
    unauthorized = {
        "error": {
            "message": "Unauthorized", "type": "AuthenticationError", "param": None, "code": 401,
        }
    }
    for method, path in [("GET", "/v1/models"), ("GET", "/metrics"), ("POST", "/v1/completions")]:
        response = call(app, method, path, json={"prompt": "Hello"}, headers={"x-request-id": "r"})
        assert (response.status_code, response.json()) == (401, unauthorized)
        assert response.headers["x-request-id"] == "r"
    assert call(app, "GET", "/health").status_code == 200


def test_wrong_api_key_or_scheme_is_401_and_the_right_key_is_200():
    app, _ = make_app(token_steps([7042]), api_key=KEY)
    for authorization in ("Bearer sk-wrong", f"Basic {KEY}", KEY, ""):
        headers = {"Authorization": authorization}
        assert call(app, "GET", "/v1/models", headers=headers).status_code == 401
    ok = call(app, "POST", "/v1/completions", json={"prompt": "Hello"},
              headers={"Authorization": f"Bearer {KEY}"})  # fmt: skip
    assert ok.status_code == 200
