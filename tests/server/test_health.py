"""One request cannot take the engine down unseen: an input whose declared shape overflows kills the model's stub
inside tritonserver 2.51's own code (before the model sees it), and then health tells the truth. The heartbeat goes
stale, the OpenAI API's /health answers 503 and its requests 503 (never 400), the supervisor restarts tritonserver,
and the next request is served as before."""
import json
import time
import urllib.error
import urllib.request

import pytest

from backend.heartbeat import STALE_S, engine_health
from tests.helpers import random_prompts
from tests.server.conftest import free_ports
from server_process import shm_regions                       # (scripts/ on the path: tests/server/conftest.py)
from tests.server.streams import run, send_lie, trtllm_inputs
from tests.server.test_supervision import read_until, start_launcher

LIES = {"input_ids INT32 [1, 2**62]": ("input_ids", "INT32", [1, 2**62]),
        "lora_weights FP16 [1, 2**62, 2]": ("lora_weights", "FP16", [1, 2**62, 2])}


def metrics_text(port: int) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()


def status_of(url: str, body: dict | None = None) -> tuple[int, str]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()
    except OSError as err:
        return 0, str(err)


def test_a_live_engine_beats(tiny_server):
    text = metrics_text(tiny_server.metrics_port)
    assert "lora_llm_engine_heartbeat_seconds" in text and engine_health(text) is None
    assert engine_health(text, now=time.time() + STALE_S + 1) is not None      # the same page, read too late


@pytest.mark.parametrize("lie", list(LIES))
def test_a_shape_lie_is_seen_and_the_supervisor_brings_the_engine_back(tiny_model_dir, lie):
    launcher, grpc = start_launcher(tiny_model_dir, "--no-openai")
    lines: list[str] = []
    url = f"127.0.0.1:{grpc}"
    try:
        read_until(launcher, "ready:", lines)
        prompt = random_prompts([9], 512, seed=61)[0]
        before = run(url, trtllm_inputs(prompt, 5, True))
        regions = shm_regions(launcher.http_port)
        error = send_lie(url, *LIES[lie])
        assert error, "a lie is answered with an error"
        lied_at = time.monotonic()
        read_until(launcher, "cannot serve", lines)
        read_until(launcher, "ready again after restart 1", lines)
        after = run(url, trtllm_inputs(prompt, 5, True))
        assert before.error is None and after.error is None and after.tokens == before.tokens
        assert time.monotonic() - lied_at < 60
        assert len(regions) == 1 and len(shm_regions(launcher.http_port)) == 1, "the dead stub's region removed"
    finally:
        launcher.terminate()
        assert launcher.wait(timeout=60) == 0
    assert not shm_regions(launcher.http_port)


def test_the_openai_api_says_503_while_the_core_is_down_and_serves_after(tiny_chat_model_dir):
    [port] = free_ports(1)
    launcher, grpc = start_launcher(tiny_chat_model_dir, "--openai-port", str(port))
    lines: list[str] = []
    base = f"http://127.0.0.1:{port}"
    body = {"model": tiny_chat_model_dir.name, "prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0}
    try:
        read_until(launcher, "openai ready", lines)
        assert status_of(f"{base}/health")[0] == 200
        assert status_of(f"{base}/v1/completions", body)[0] == 200
        send_lie(f"127.0.0.1:{grpc}", *LIES["input_ids INT32 [1, 2**62]"])
        seen: set[int] = set()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            health, (code, text) = status_of(f"{base}/health")[0], status_of(f"{base}/v1/completions", body)
            seen.add(health)
            assert code in (200, 503), f"an unavailable core is a 503, never {code}: {text}"
            if 503 in seen and health == 200 and code == 200:
                break
            time.sleep(0.2)
        assert 503 in seen, "health never said the core was down"
        assert health == 200 and code == 200, "the API did not serve again after the restart"
        read_until(launcher, "cannot serve", lines)                 # the supervisor saw it, and restarted it
    finally:
        launcher.terminate()
        assert launcher.wait(timeout=60) == 0

