"""The OpenAI API's front door on a real tritonserver (SmolLM2): adapter loading off unless turned on, then only with
the admin key, only from the allowed roots and only valid adapters; one client cannot stall the others; vLLM's guided
fields honored, unknown fields refused."""
import http.client
import json
import os
import threading
import time

import httpx
import numpy as np
import pytest

from backend.lora.peft import save_trtllm
from tests.helpers import ALL_MODULES, make_peft_adapters
from tests.server.conftest import run_frontend

pytestmark = pytest.mark.slow
BASE = "smollm2-135m-instruct"
KEYS = {"inference": "sk-inference-doors", "admin": "sk-admin-doors"}
ADMIN = {"Authorization": f"Bearer {KEYS['admin']}"}
USER = {"Authorization": f"Bearer {KEYS['inference']}"}


@pytest.fixture(scope="module")
def roots(smollm2_dir, tmp_path_factory):
    """An adapter store (one PEFT adapter), an allowed root (a valid and a broken adapter) and a folder outside."""
    base = tmp_path_factory.mktemp("doors")
    [good] = make_peft_adapters(smollm2_dir, base, scale=0.02, specs=[dict(r=8, lora_alpha=16,
                                                                         target_modules=ALL_MODULES)])
    (base / "store").mkdir()
    good.rename(base / "store" / "kept")
    (base / "allowed").mkdir()
    (base / "outside").mkdir()
    for folder in ("allowed/good", "outside/evil"):
        (base / folder).mkdir()
        for file in (base / "store" / "kept").iterdir():
            (base / folder / file.name).write_bytes(file.read_bytes())
    weights = np.full((1, 8 * (576 + 576)), np.nan, np.float16)               # rank 8 q_proj, all NaN
    save_trtllm(base / "allowed" / "nan", weights, np.array([[1, 0, 8]], np.int32))
    (base / "allowed" / "junk").mkdir()
    (base / "allowed" / "junk" / "model.lora_weights.npy").write_bytes(b"junk")
    (base / "allowed" / "link-out").symlink_to(base / "outside" / "evil")
    return base


@pytest.fixture(scope="module")
def doors(tmp_path_factory, smollm2_server, smollm2_dir, roots):
    keys = roots / "keys.json"
    keys.write_text(json.dumps(KEYS))
    yield from run_frontend(tmp_path_factory, smollm2_server, smollm2_dir, "--adapter-store", str(roots / "store"),
                            "--lora-roots", str(roots / "allowed"), "--api-key-file", str(keys),
                            "--allow-runtime-lora-updating")


@pytest.fixture(scope="module")
def closed(tmp_path_factory, smollm2_server, smollm2_dir, roots):
    """The API as serve.sh starts it: no keys, runtime loading off."""
    yield from run_frontend(tmp_path_factory, smollm2_server, smollm2_dir, "--adapter-store", str(roots / "store"))


def load(frontend, name: str, path: str, headers=ADMIN) -> httpx.Response:
    return httpx.post(frontend.url + "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path},
                      headers=headers, timeout=60)


def chat(frontend, model: str, **extra) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0}
    return httpx.post(frontend.url + "/v1/chat/completions", json=body | extra, headers=USER, timeout=60)


def test_loading_is_refused_while_it_is_off(closed, roots):
    assert load(closed, "x", str(roots / "allowed" / "good"), headers={}).status_code == 403
    r = httpx.post(closed.url + "/v1/unload_lora_adapter", json={"lora_name": "kept"})
    assert r.status_code == 403 and "--allow-runtime-lora-updating" in r.json()["error"]["message"]
    assert "kept" in {m["id"] for m in httpx.get(closed.url + "/v1/models").json()["data"]}


def test_loading_is_refused_outside_the_roots_and_with_the_inference_key(doors, roots):
    for path in (str(roots / "outside" / "evil"), "../outside/evil", str(roots / "allowed" / "link-out"), "/etc"):
        r = load(doors, "evil", path)
        assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path", (path, r.text)
    assert load(doors, "good", str(roots / "allowed" / "good"), headers=USER).status_code == 401
    assert chat(doors, "evil").status_code == 404 and chat(doors, "good").status_code == 404
    r = httpx.post(doors.url + "/v1/unload_lora_adapter", json={"lora_name": "kept"}, headers=ADMIN)
    assert r.status_code == 400 and chat(doors, "kept").status_code == 200          # the store's stay


@pytest.mark.parametrize("folder, words", [("nan", "NaN"), ("junk", "model.lora_weights.npy")])
def test_a_broken_adapter_is_400_and_the_connection_serves_on(doors, roots, folder, words):
    connection = http.client.HTTPConnection("127.0.0.1", doors.port, timeout=60)
    try:
        body = json.dumps({"lora_name": folder, "lora_path": str(roots / "allowed" / folder)})
        connection.request("POST", "/v1/load_lora_adapter", body, ADMIN | {"Content-Type": "application/json"})
        answer = connection.getresponse()
        error = json.loads(answer.read())["error"]
        assert answer.status == 400 and error["param"] == "lora_path" and words in error["message"]
        connection.request("GET", "/v1/models", headers=USER)                  # the same connection
        answer = connection.getresponse()
        models = {m["id"] for m in json.loads(answer.read())["data"]}
        assert answer.status == 200 and folder not in models
    finally:
        connection.close()


def test_two_loads_of_one_name_at_once_one_wins_and_both_are_answered(doors, roots):
    paths = [str(roots / "allowed" / "good"), "kept"]
    answers = [None, None]

    def send(i):
        answers[i] = load(doors, "twin", paths[i])
    threads = [threading.Thread(target=send, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(a.status_code for a in answers) == [200, 400], [a.text for a in answers]
    assert "already" in next(a for a in answers if a.status_code == 400).json()["error"]["message"]
    assert chat(doors, "twin").status_code == 200


def resident_mb(pid: int) -> float:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def post_raw(frontend, route: str, body: bytes) -> tuple[httpx.Response, float]:
    started = time.monotonic()
    r = httpx.post(frontend.url + route, content=body, timeout=120, headers=USER | {"Content-Type": "application/json"})
    return r, time.monotonic() - started


def test_a_million_empty_messages_are_refused_at_once_and_cost_the_api_no_memory(doors):
    before = resident_mb(doors.process.pid)
    body = b'{"model": "%s", "messages": [%s]}' % (BASE.encode(), b",".join([b'{"role": "user", "content": ""}']
                                                                            * 1_000_000))
    r, took = post_raw(doors, "/v1/chat/completions", body)
    assert r.status_code == 413 and took < 1.0, (took, r.text[:200])
    assert resident_mb(doors.process.pid) - before < 100
    many = {"model": BASE, "messages": [{"role": "user", "content": ""}] * 1025}
    r = httpx.post(doors.url + "/v1/chat/completions", json=many, headers=USER, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("messages") and "1024" in r.text


def test_a_batch_of_prompts_is_bounded_as_a_whole_before_any_is_tokenized(doors):
    body = json.dumps({"model": BASE, "prompt": ["lorem ipsum " * 50_000] * 12}).encode()     # 7.2 MB of text
    r, took = post_raw(doors, "/v1/completions", body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt" and "in this request" in r.text
    assert took < 1.0, took


@pytest.mark.parametrize("bias, words", [({"1" * 5000: 1.0}, "ASCII digits"), ({"١٢": 1.0}, "ASCII digits"),
                                         ({str(i): 1.0 for i in range(1025)}, "1024")])
def test_a_logit_bias_past_its_bounds_is_a_400_naming_it(doors, bias, words):
    r = chat(doors, BASE, logit_bias=bias)
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("logit_bias") and words in r.text, r.text


def test_a_30_mib_prompt_is_refused_at_once_while_a_stream_keeps_its_cadence(doors):
    arrivals = []

    def stream():
        body = {"model": BASE, "prompt": "Once upon a time", "max_tokens": 48, "ignore_eos": True, "stream": True,
                "temperature": 0}
        with httpx.stream("POST", doors.url + "/v1/completions", json=body, headers=USER, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data:"):
                    arrivals.append(time.monotonic())
    streaming = threading.Thread(target=stream)
    streaming.start()
    while len(arrivals) < 3:
        time.sleep(0.01)
    huge = b'{"model": "%s", "prompt": "%s"}' % (BASE.encode(), b"lorem ipsum " * ((30 << 20) // 12))
    started = time.monotonic()
    r = httpx.post(doors.url + "/v1/completions", content=huge, timeout=120,
                   headers=USER | {"Content-Type": "application/json"})
    took = time.monotonic() - started
    streaming.join()
    assert r.status_code == 413 and r.json()["error"]["param"] == "body" and took < 1.0, (took, r.text[:200])
    gaps = np.diff(arrivals)
    assert len(arrivals) >= 48 and gaps.max() < 1.0, gaps.max()


def test_guided_json_is_honored_and_unknown_fields_are_refused(doors):
    schema = {"type": "object", "additionalProperties": False, "required": ["n"],
              "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}}
    for guide in ({"guided_json": schema}, {"structured_outputs": {"json": schema}}):
        r = chat(doors, BASE, max_tokens=32, **guide)
        assert r.status_code == 200, r.text
        value = json.loads(r.json()["choices"][0]["message"]["content"])
        assert set(value) == {"n"} and 0 <= value["n"] <= 9
    r = chat(doors, BASE, guided_choice=["red", "green", "blue"])
    assert r.json()["choices"][0]["message"]["content"] in ("red", "green", "blue")
    for field, value in (("chat_template", "{{ 'x' }}"), ("guided_whitespace_pattern", " ")):
        r = chat(doors, BASE, **{field: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == field


def test_the_api_reaches_a_restarted_tritonserver_within_a_second(tiny_model_dir, tmp_path):
    """After a 30-s outage gRPC's default backoff would wait up to ~17 s more; the API's channel tries every second."""
    import asyncio
    import signal

    from frontend.core import CoreClient
    from tests.server.conftest import TINY_ENV, free_ports, start_server, wait_ready

    http_port, grpc_port, metrics_port = free_ports(3)
    env = TINY_ENV | {"LORA_LLM_MODEL_DIR": str(tiny_model_dir)}

    def server():
        process = start_server(http_port, grpc_port, metrics_port, env=env, models=["lora_llm"],
                               log_file=open(tmp_path / "tritonserver.log", "a"))
        wait_ready(process, http_port)
        return process

    async def outage_then_back() -> float:
        core = CoreClient(f"127.0.0.1:{grpc_port}")
        process = server()
        try:
            assert await core.ready()
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            down_until = time.monotonic() + 30
            while time.monotonic() < down_until:
                assert not await core.ready()
                await asyncio.sleep(0.5)
            process = server()                                 # listening again from here
            back = time.monotonic()
            while not await core.ready():
                await asyncio.sleep(0.05)
            return time.monotonic() - back
        finally:
            process.terminate()
            process.wait(timeout=30)
            await core.close()
    took = asyncio.run(outage_then_back())
    assert took < 1.5, took


def test_a_peft_dora_adapter_loads_through_the_front_door(doors, roots, smollm2_dir, smollm2_server):
    """A PEFT DoRA folder (use_dora, lora_magnitude_vector) loaded at run time: the API normalizes its magnitudes
    against the served model's checkpoint and sends TensorRT-LLM's four-column tensors; its answers are the core
    model's for the same tensors sent directly."""
    from backend.lora.dora import checkpoint_weights
    from backend.lora.peft import peft_to_trtllm
    from tests.helpers import make_peft_adapters
    from tests.server.streams import run, trtllm_inputs
    [path] = make_peft_adapters(smollm2_dir, roots / "allowed", seed=9, scale=0.3,
                                specs=[dict(r=8, lora_alpha=16, use_dora=True, target_modules=ALL_MODULES)])
    assert load(doors, "dora", str(path)).status_code == 200
    r = httpx.post(doors.url + "/v1/completions", headers=USER, timeout=60,
                   json={"model": "dora", "prompt": [5, 6, 7, 8], "max_tokens": 6, "temperature": 0,
                         "ignore_eos": True})
    assert r.status_code == 200, r.text
    weights, config = peft_to_trtllm(path, "float16", checkpoint_weights(smollm2_dir))
    core = run(smollm2_server.grpc_url, trtllm_inputs([5, 6, 7, 8], 6, True, end_id=np.array([[-1]], np.int32),
                                                      lora_task_id=np.array([[74001]], np.uint64),
                                                      lora_weights=weights[None], lora_config=config[None]))
    assert core.error is None and r.json()["usage"]["completion_tokens"] == 6
    from transformers import AutoTokenizer
    assert r.json()["choices"][0]["text"] == AutoTokenizer.from_pretrained(smollm2_dir).decode(core.tokens)
