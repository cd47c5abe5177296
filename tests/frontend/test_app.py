"""The API's own rules, in process (no core model needed): who may load adapters, errors always in OpenAI's shape,
bodies and prompts refused before they cost memory or time."""
import asyncio

import pytest
from fastapi.testclient import TestClient

from frontend.app import FrontendConfig, create_app
from frontend.middleware import CatchAll, error_response

KEYS = {"api_key": "sk-inference", "admin_key": "sk-admin"}


@pytest.fixture(scope="module")
def app(tiny_chat_model_dir):
    with TestClient(create_app(FrontendConfig(model_dir=str(tiny_chat_model_dir), max_body_bytes=1 << 20))) as client:
        yield client


@pytest.mark.parametrize("settings, words", [
    (dict(host="0.0.0.0"), "needs both keys"), (dict(host="10.1.2.3", api_key="a"), "needs both keys"),
    (dict(api_key="same", admin_key="same"), "distinct"), (dict(api_key="a"), "admin key")])
def test_runtime_loading_refuses_to_start_without_the_keys_it_needs(tiny_chat_model_dir, settings, words):
    with pytest.raises(ValueError, match=words):
        FrontendConfig(model_dir=str(tiny_chat_model_dir), allow_runtime_lora_updating=True, **settings)


def test_runtime_loading_starts_with_distinct_keys_anywhere_and_without_keys_only_on_loopback(tiny_chat_model_dir):
    FrontendConfig(model_dir=str(tiny_chat_model_dir), allow_runtime_lora_updating=True, host="0.0.0.0", **KEYS)
    local = FrontendConfig(model_dir=str(tiny_chat_model_dir), allow_runtime_lora_updating=True)
    assert "local development" in local.warnings[0]
    FrontendConfig(model_dir=str(tiny_chat_model_dir), host="0.0.0.0")      # loading off: no keys needed


def test_adapter_routes_are_refused_while_loading_is_off(app):
    for route, body in (("load", {"lora_name": "x", "lora_path": "x"}), ("unload", {"lora_name": "x"})):
        r = app.post(f"/v1/{route}_lora_adapter", json=body)
        assert r.status_code == 403 and "--allow-runtime-lora-updating" in r.json()["error"]["message"]


def test_a_body_past_the_limit_is_413_in_openais_shape_also_when_chunked(app):
    def chunks():
        for _ in range(32):
            yield b"x" * (64 << 10)
    for body in (b"{" + b" " * (2 << 20) + b"}", chunks()):
        r = app.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["param"] == "body", r.text


def test_a_prompt_that_cannot_fit_is_refused_before_it_is_tokenized(app):
    r = app.post("/v1/completions", json={"model": "m", "prompt": "word " * 200_000})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt" and "cannot fit" in r.text
    r = app.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "a" * 900_000}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def test_unknown_fields_and_routes_answer_in_openais_shape(app, tiny_chat_model_dir):
    name = tiny_chat_model_dir.name
    r = app.post("/v1/chat/completions", json={"model": name, "messages": [{"role": "user", "content": "hi"}],
                                               "chat_template": "{{ 'x' }}"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template"
    r = app.get("/v1/no-such-route")
    assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"


def test_models_show_names_not_server_paths(app, tiny_chat_model_dir):
    [base] = app.get("/v1/models").json()["data"]
    assert base["root"] == base["id"] == tiny_chat_model_dir.name and "/" not in str(base)


def test_an_unexpected_error_is_a_500_in_openais_shape_and_a_429_says_when_to_retry():
    async def broken(scope, receive, send):
        raise RuntimeError("a bug: /internal/path")
    messages = []

    async def send(message):
        messages.append(message)
    asyncio.run(CatchAll(broken)({"type": "http", "method": "GET", "path": "/v1/models"}, None, send))
    assert messages[0]["status"] == 500 and b"internal_error" in messages[1]["body"]
    assert b"/internal/path" not in messages[1]["body"]
    from frontend.errors import OpenAIError
    assert error_response(OpenAIError(429, "queue full", "RateLimitError")).headers["Retry-After"] == "1"
