"""One request cannot take the engine down: an input whose declared shape lies kills the model's stub inside
tritonserver 2.51's own code (before the model sees it). The engine, in a process of its own, cancels that stub's
requests and asks for a new stub, which finds it with its caches; health says so meanwhile (the heartbeat goes
stale within a second), and the OpenAI API answers 503, never 400."""
import json
import time
import urllib.error
import urllib.request


import numpy as np

from backend.processes import running

from backend.serving.heartbeat import RESTART_STALE_S, SERVER_CALL_S, STALE_S, engine_health, engines_dir
from tests.helpers import random_prompts
from tests.server.conftest import TINY_ENV, engine_pid, free_ports
from server_process import shm_regions                       # (scripts/ on the path: tests/server/conftest.py)
from tests.server.streams import Stream, run, send_lie, trtllm_inputs
from tests.server.test_faults import lora_inputs
from tests.server.test_supervision import read_until, start_launcher, stderr_tail

# Each kills the Python backend's stub in tritonserver 2.51 before model.py sees the request: (input, datatype, shape,
# data). Zero-size inputs with a huge other dim, negative dims whose product matches the bytes sent, shapes that wrap.
LIES = {"input_ids INT32 [1, 2**62]": ("input_ids", "INT32", [1, 2**62], b""),
        "lora_weights FP16 [1, 2**62, 2]": ("lora_weights", "FP16", [1, 2**62, 2], b""),
        "lora_config INT32 [1, 0, 2**62]": ("lora_config", "INT32", [1, 0, 2**62], b""),
        "lora_weights FP16 [1, 2**62, 0]": ("lora_weights", "FP16", [1, 2**62, 0], b""),
        "embedding_bias FP32 [0, 2**62]": ("embedding_bias", "FP32", [0, 2**62], b""),
        "lora_weights FP16 [1, -2, -4]": ("lora_weights", "FP16", [1, -2, -4], bytes(16)),
        "lora_config INT32 [1, -2, -3]": ("lora_config", "INT32", [1, -2, -3], bytes(24))}
NUM_LIES = 20
SERVED_AGAIN_S = 3.0


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


def tritonserver_pid(lines: list[str]) -> int:
    return int([line for line in lines if "tritonserver pid" in line][-1].split("pid ")[1].split()[0])


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def said_cannot_serve(metrics_port: int) -> bool:
    """Whether the metrics say the engine cannot serve (a read refused on two busy cores says nothing yet)."""
    try:
        return engine_health(metrics_text(metrics_port)) is not None
    except OSError:
        return False


def served_again(url: str, arrays: dict, metrics_port: int, timeout_s: float = 60,
                 headers: dict[str, str] | None = None) -> tuple[float, bool, object]:
    """Requests until one is answered: seconds it took, whether the metrics said the engine could not serve
    meanwhile (polled between requests), and the answer."""
    start, red = time.monotonic(), False
    while time.monotonic() - start < timeout_s:
        red = red or said_cannot_serve(metrics_port)
        result = run(url, arrays, headers=headers)
        if result.error is None:
            return time.monotonic() - start, red, result
        time.sleep(0.05)
    raise AssertionError(f"not served again within {timeout_s} s: {result.error}")


def test_lies_that_kill_the_stub_cost_seconds_and_no_state(tiny_model_dir, tiny_adapters):
    """Twenty lies in a row, the whole family: after each, the other clients are served again within seconds by a new
    stub that finds the same engine (an adapter cached before still cached, the same tokens), readiness said so
    meanwhile, tritonserver was not restarted, no shared memory region is left behind, and memory stays flat."""
    launcher, grpc = start_launcher(tiny_model_dir, "--no-openai")
    lines: list[str] = []
    url = f"127.0.0.1:{grpc}"
    metrics_port = launcher.metrics_port
    try:
        read_until(launcher, "ready:", lines)
        server_pid, engine = tritonserver_pid(lines), engine_pid(launcher.http_port)
        prompt = random_prompts([9], 512, seed=61)[0]
        base = run(url, trtllm_inputs(prompt, 5, True))
        adapter = run(url, trtllm_inputs(prompt, 5, True) | lora_inputs(tiny_adapters, task_id=7))
        assert base.error is None and adapter.error is None and adapter.tokens != base.tokens
        regions = shm_regions(launcher.http_port)
        seconds, reds, memory = [], [], []
        for i in range(NUM_LIES):
            name, datatype, shape, data = list(LIES.values())[i % len(LIES)]
            assert send_lie(url, name, datatype, shape, data=data), "a lie is answered with an error"
            took, red, again = served_again(url, trtllm_inputs(prompt, 5, True), metrics_port)
            assert again.tokens == base.tokens
            seconds.append(took)
            reds.append(red or took < STALE_S + 0.5)        # (a new stub within a second: nothing to say)
            assert running(server_pid), f"tritonserver died at lie {i} ({name}):\n{stderr_tail(launcher)}"
            memory.append(rss_mb(server_pid) + rss_mb(engine))
        cached = run(url, trtllm_inputs(prompt, 5, True, lora_task_id=np.array([[7]], np.uint64)))
        assert cached.error is None and cached.tokens == adapter.tokens, "the engine's adapter cache survived"
        print(f"served again after {', '.join(f'{s:.2f}' for s in seconds)} s; tritonserver + engine RSS "
              f"{memory[0]:.0f} -> {memory[-1]:.0f} MB")
        assert sorted(seconds)[len(seconds) // 2] < SERVED_AGAIN_S and max(seconds) < 2 * SERVED_AGAIN_S, seconds
        assert all(reds), "the metrics said the engine could not serve while no stub served"
        assert engine_pid(launcher.http_port) == engine and not any("tritonserver died" in line for line in lines)
        assert len(shm_regions(launcher.http_port)) == len(regions) == 1, "each dead stub's region removed"
        assert memory[-1] < memory[1] * 1.05 + 20, memory
    finally:
        launcher.terminate()
        assert launcher.wait(timeout=60) == 0
    assert not shm_regions(launcher.http_port) and not list(engines_dir().glob(f"engine-port{launcher.http_port}-*"))


def test_a_lie_with_streams_in_flight_restarts_tritonserver_not_the_engine(tiny_model_dir, tiny_adapters):
    """tritonserver 2.51 never ends the requests of a stub that died: under the supervisor it is killed instead, its
    clients see their streams end (no client waits forever), and the new tritonserver finds the same engine."""
    launcher, grpc = start_launcher(tiny_model_dir, "--no-openai")
    lines: list[str] = []
    url = f"127.0.0.1:{grpc}"
    try:
        read_until(launcher, "ready:", lines)
        engine = engine_pid(launcher.http_port)
        prompt = random_prompts([9], 512, seed=62)[0]
        adapter = run(url, trtllm_inputs(prompt, 5, True) | lora_inputs(tiny_adapters, task_id=8))
        streams = [Stream(url).send(trtllm_inputs(prompt, 480, True)) for _ in range(4)]
        for stream in streams:
            stream.wait_first(timeout_s=30)
        lied_at = time.monotonic()
        assert send_lie(url, *LIES["input_ids INT32 [1, 2**62]"][:3])
        results = [stream.collect(timeout_s=30) for stream in streams]
        for stream in streams:
            stream.close()
        assert all(r.error is not None or r.num_final == 1 for r in results), "every client's stream ended"
        read_until(launcher, "ready again after restart 1", lines)
        cached = run(url, trtllm_inputs(prompt, 5, True, lora_task_id=np.array([[8]], np.uint64)))
        print(f"served again {time.monotonic() - lied_at:.1f} s after the lie")
        assert cached.error is None and cached.tokens == adapter.tokens, "the engine survived tritonserver"
        assert engine_pid(launcher.http_port) == engine
    finally:
        launcher.terminate()
        assert launcher.wait(timeout=60) == 0


def test_a_call_into_tritonserver_that_never_returns_restarts_it_not_the_engine(tiny_model_dir, tiny_adapters,
                                                                               tmp_path):
    """tritonserver 2.51's gRPC frontend can deadlock a stream's response and cancellation check, after which no
    stream gets an answer (docs/reliability.md). Injected (the inject_stuck_call_file hook: the stub's next call into
    tritonserver never returns): after SERVER_CALL_S the stub's heartbeat stops and says why, the metrics say the
    engine cannot serve a second later, the supervisor kills tritonserver RESTART_STALE_S after that and starts it
    again, and the new one serves with the same engine and its caches."""
    stuck = tmp_path / "stuck"
    launcher, grpc = start_launcher(tiny_model_dir, "--no-openai",
                                    settings=TINY_ENV | {"LORA_LLM_INJECT_STUCK_CALL_FILE": str(stuck)})
    lines: list[str] = []
    url = f"127.0.0.1:{grpc}"
    try:
        read_until(launcher, "ready:", lines)
        engine = engine_pid(launcher.http_port)
        prompt = random_prompts([9], 512, seed=63)[0]
        adapter = run(url, trtllm_inputs(prompt, 5, True) | lora_inputs(tiny_adapters, task_id=9))
        assert adapter.error is None
        stuck.touch()
        stream = Stream(url).send(trtllm_inputs(prompt, 64, True))
        stuck_at = time.monotonic()
        while not said_cannot_serve(launcher.metrics_port) and time.monotonic() - stuck_at < 60:
            time.sleep(0.1)
        red_after = time.monotonic() - stuck_at
        read_until(launcher, "cannot serve (its health check failed twice); killing it", lines, timeout_s=60)
        killed_after = time.monotonic() - stuck_at
        result = stream.collect(timeout_s=30)
        stream.close()
        read_until(launcher, "ready again after restart 1", lines)
        cached = run(url, trtllm_inputs(prompt, 5, True, lora_task_id=np.array([[9]], np.uint64)))
        print(f"red {red_after:.1f} s after the stuck call, tritonserver killed after {killed_after:.1f} s, serving "
              f"again after {time.monotonic() - stuck_at:.1f} s")
        assert not stuck.exists(), "a call took the hook"
        assert SERVER_CALL_S < red_after < SERVER_CALL_S + 3, red_after
        assert red_after + RESTART_STALE_S < killed_after < red_after + RESTART_STALE_S + 5, killed_after
        assert "a call into tritonserver (a response or a cancellation check) has run" in stderr_tail(launcher, 1 << 20)
        assert result.error is not None or result.num_final == 1, "the stuck stream ended"
        assert cached.error is None and cached.tokens == adapter.tokens, "the engine and its adapter cache survived"
        assert engine_pid(launcher.http_port) == engine
    finally:
        launcher.terminate()
        assert launcher.wait(timeout=60) == 0


def test_the_openai_api_answers_503_or_serves_while_a_stub_is_replaced(tiny_chat_model_dir):
    [port] = free_ports(1)
    launcher, grpc = start_launcher(tiny_chat_model_dir, "--openai-port", str(port))
    lines: list[str] = []
    base = f"http://127.0.0.1:{port}"
    body = {"model": tiny_chat_model_dir.name, "prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0}
    try:
        read_until(launcher, "openai ready", lines)
        assert status_of(f"{base}/health")[0] == 200
        assert status_of(f"{base}/v1/completions", body)[0] == 200
        send_lie(f"127.0.0.1:{grpc}", *LIES["input_ids INT32 [1, 2**62]"][:3])
        codes: list[int] = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            code, text = status_of(f"{base}/v1/completions", body)
            codes.append(code)
            assert code in (200, 503), f"an unavailable core is a 503, never {code}: {text}"
            if code == 200 and status_of(f"{base}/health")[0] == 200:
                break
            time.sleep(0.1)
        assert codes[-1] == 200, "the API did not serve again"
    finally:
        launcher.terminate()
        assert launcher.wait(timeout=60) == 0
