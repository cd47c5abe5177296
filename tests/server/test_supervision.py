"""scripts/launch_server.py supervises tritonserver and the OpenAI API: each killed with SIGKILL is logged and started
again on its own, and serves as before; stopped, it ends tritonserver even where tritonserver would not end by
itself."""
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

import numpy as np
import pytest
from transformers import AutoTokenizer

from backend.processes import running
from tests.helpers import ROOT, random_prompts
from tests.server.conftest import TINY_ENV, engine_pid, free_ports
from tests.server.streams import Stream, run, trtllm_inputs


def start_launcher(model_dir, *args: str, settings: dict | None = None) -> tuple[subprocess.Popen, int]:
    """launch_server.py on free ports (the tiny model's settings unless given), lora_llm only: the launcher and its
    gRPC port."""
    http, grpc, metrics = free_ports(3)
    env = os.environ | (TINY_ENV if settings is None else settings) | {"LORA_LLM_MODEL_DIR": str(model_dir)}
    log = tempfile.TemporaryFile()                          # (gone when closed)
    launcher = subprocess.Popen([sys.executable, "-u", ROOT / "scripts" / "launch_server.py", "--http-port", str(http),
                                 "--grpc-port", str(grpc), "--metrics-port", str(metrics), "--models", "lora_llm",
                                 *args], env=env, stdout=subprocess.PIPE, stderr=log, text=True)
    launcher.http_port, launcher.metrics_port, launcher.stderr_log = http, metrics, log
    return launcher, grpc


def stderr_tail(launcher: subprocess.Popen, num_chars: int = 4000) -> str:
    """The end of what the launcher and its servers wrote to stderr (tritonserver's log: why it died)."""
    launcher.stderr_log.seek(0)
    return launcher.stderr_log.read().decode(errors="replace")[-num_chars:]




def pump_lines(process: subprocess.Popen) -> None:
    for line in process.stdout:
        process.stdout_lines.put(line)
    process.stdout_lines.put("")                             # its end


def read_until(process: subprocess.Popen, marker: str, lines: list[str], timeout_s: float = 300) -> str:
    """The process's stdout lines (each kept in `lines`, read on a thread of its own) until one holds `marker`; an
    AssertionError with what it printed, and its stderr's end where kept, if it ends or timeout_s passes first."""
    if not hasattr(process, "stdout_lines"):
        process.stdout_lines = queue.Queue()
        threading.Thread(target=pump_lines, args=(process,), daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        try:
            line = process.stdout_lines.get(timeout=left)
        except queue.Empty:
            break
        if not line:
            break
        lines.append(line)
        if marker in line:
            return line
    stderr = f"\nits stderr ends:\n{stderr_tail(process)}" if hasattr(process, "stderr_log") else ""
    raise AssertionError(f"no {marker!r} from the launcher:\n{''.join(lines)[-3000:]}{stderr}")


def test_a_killed_tritonserver_is_restarted_and_serves_the_same_tokens(tiny_model_dir):
    launcher, grpc = start_launcher(tiny_model_dir)
    lines: list[str] = []
    try:
        pid = int(read_until(launcher, "tritonserver pid", lines).split("pid ")[1].split()[0])
        read_until(launcher, "ready:", lines)
        prompt = random_prompts([10], 512, seed=47)[0]
        before = run(f"127.0.0.1:{grpc}", trtllm_inputs(prompt, 6, True))
        os.kill(pid, signal.SIGKILL)
        assert "killed by SIGKILL" in read_until(launcher, "tritonserver died", lines)
        read_until(launcher, "ready again after restart 1", lines)
        after = run(f"127.0.0.1:{grpc}", trtllm_inputs(prompt, 6, True))
        assert before.error is None and after.tokens == before.tokens and len(after.tokens) == 6
    finally:
        launcher.terminate()
        assert launcher.wait(timeout=60) == 0


def test_a_stop_ends_tritonserver_even_while_a_client_holds_its_stream_open(tiny_model_dir):
    launcher, grpc = start_launcher(tiny_model_dir, "--exit-timeout-s", "2")
    lines: list[str] = []
    stream = None
    try:
        pid = int(read_until(launcher, "tritonserver pid", lines).split("pid ")[1].split()[0])
        read_until(launcher, "ready:", lines)
        stream = Stream(f"127.0.0.1:{grpc}").send(trtllm_inputs(random_prompts([8], 512, seed=48)[0], 3, True))
        assert len(stream.collect().tokens) == 3                  # answered; the stream stays open
        launcher.send_signal(signal.SIGTERM)
        launcher.wait(timeout=30)                                 # 2 s exit timeout + 5 s, then killed
        read_until(launcher, "killing it", lines)
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    finally:
        if stream is not None:
            stream.close()
        launcher.kill()
        launcher.wait(timeout=60)


def test_stop_server_kills_a_held_tritonserver_and_its_stubs_after_the_exit_timeout(tiny_model_dir):
    """server_process.stop_server, with which benches, checks and tests stop their servers, against the same hold."""
    from server_process import start_server, stop_server, wait_ready
    http, grpc, metrics = free_ports(3)
    server = start_server(http, grpc, metrics, env=TINY_ENV | {"LORA_LLM_MODEL_DIR": str(tiny_model_dir)},
                          log_file=subprocess.DEVNULL, models=["lora_llm"], exit_timeout_s=1)
    stream = None
    try:
        wait_ready(server, http)
        below = descendants(server.pid)                           # the stub and what it started
        stream = Stream(f"127.0.0.1:{grpc}").send(trtllm_inputs(random_prompts([8], 512, seed=53)[0], 3, True))
        assert len(stream.collect().tokens) == 3
        start = time.monotonic()
        stop_server(server, exit_timeout_s=1)
        assert server.returncode == -signal.SIGKILL               # it would not have ended by itself
        assert time.monotonic() - start < 1 + 5 + 5
        deadline = time.monotonic() + 5
        while any(map(running, below)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert below and not any(map(running, below))
    finally:
        if stream is not None:
            stream.close()
        if server.poll() is None:
            server.kill()
            server.wait()


def test_a_killed_openai_frontend_is_restarted_while_tritonserver_serves_on(tiny_chat_model_dir):
    [port] = free_ports(1)
    launcher, grpc = start_launcher(tiny_chat_model_dir, "--openai-port", str(port))
    lines: list[str] = []
    try:
        triton_pid = int(read_until(launcher, "tritonserver pid", lines).split("pid ")[1].split()[0])
        frontend_pid = int(read_until(launcher, "openai pid", lines).split("pid ")[1].split()[0])
        read_until(launcher, "openai ready", lines)
        prompt = random_prompts([10], 512, seed=49)[0]
        before = run(f"127.0.0.1:{grpc}", trtllm_inputs(prompt, 6, True))
        os.kill(frontend_pid, signal.SIGKILL)
        assert "killed by SIGKILL" in read_until(launcher, "openai died", lines)
        read_until(launcher, "openai ready on http://127.0.0.1", lines)
        body = b'{"model": "%s", "prompt": %s, "max_tokens": 6, "temperature": 0, "ignore_eos": true}' % (
            tiny_chat_model_dir.name.encode(), str(prompt).encode())
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                         {"Content-Type": "application/json"})
        answer = json.loads(urllib.request.urlopen(request, timeout=30).read())
        tokenizer = AutoTokenizer.from_pretrained(tiny_chat_model_dir)
        assert answer["choices"][0]["text"] == tokenizer.decode(before.tokens, skip_special_tokens=True)
        assert answer["usage"]["completion_tokens"] == 6 == len(before.tokens)
        os.kill(triton_pid, 0)                                    # tritonserver never went away
        assert not any("tritonserver died" in line for line in lines)
    finally:
        launcher.terminate()
        assert launcher.wait(timeout=60) == 0


def descendants(pid: int) -> set[int]:
    """Every process below `pid` (its children, theirs, ...), from /proc."""
    parents = {}
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
        except (ValueError, OSError):
            continue
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def test_a_tritonserver_killed_mid_stream_leaves_no_stub_behind_every_client_an_error_and_its_engine(smollm2_dir,
                                                                                                    demo_adapters):
    """Killed while its engine steps with an adapter, tritonserver used to leave the engine's stub running (reparented,
    deaf to SIGTERM, its memory held) beside the restarted one. Its stubs end; its engine process serves the restarted
    one (one engine, not two)."""
    launcher, grpc = start_launcher(smollm2_dir, "--no-openai", "--lora-prefetch-dir", str(demo_adapters),
                                    settings={"LORA_LLM_KV_CACHE_MEMORY_BYTES": str(256 << 20)})
    lines: list[str] = []
    streams = []
    try:
        pid = int(read_until(launcher, "tritonserver pid", lines).split("pid ")[1].split()[0])
        read_until(launcher, "ready:", lines)
        prompts = random_prompts([12, 20, 28], 49152, seed=50)
        task = np.array([[1]], np.uint64)
        streams = [Stream(f"127.0.0.1:{grpc}").send(trtllm_inputs(p, 400, True, lora_task_id=task)) for p in prompts]
        for stream in streams:
            stream.wait_first()
        time.sleep(1)
        engine = engine_pid(launcher.http_port)
        old = sorted(set(descendants(pid)) - {engine} - set(descendants(engine)))     # (its grammar workers)
        assert old, "tritonserver runs its model in a stub process"
        os.kill(pid, signal.SIGKILL)
        results = [stream.collect(timeout_s=60) for stream in streams]
        read_until(launcher, "ready again after restart 1", lines)
        assert [p for p in old if running(p)] == [], "".join(lines)[-2000:]
        assert engine_pid(launcher.http_port) == engine and running(engine)
        assert all(r.error is not None for r in results), [r.error for r in results]
        after = run(f"127.0.0.1:{grpc}", trtllm_inputs(prompts[0], 4, True))
        assert after.error is None and len(after.tokens) == 4
    finally:
        for stream in streams:
            stream.close()
        launcher.terminate()
        assert launcher.wait(timeout=60) == 0


def listening_addresses(port: int) -> set[str]:
    """The local IPv4 addresses (hex, as /proc/net/tcp writes them; IPv6's any and mapped ones as their IPv4) that
    listen on this TCP port."""
    mapped = {"0" * 32: "00000000"}
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                address, hex_port = local.rsplit(":", 1)
                if state == "0A" and int(hex_port, 16) == port:
                    ipv4 = address[24:] if address.startswith("0000000000000000FFFF0000") else address
                    found.add(mapped.get(ipv4, ipv4))
    return found


def test_a_killed_supervisor_leaves_no_process_holding_its_ports(tiny_chat_model_dir):
    """SIGKILLed, the supervisor cannot stop its children: they die with it (PR_SET_PDEATHSIG), ports and all."""
    http, grpc, metrics, openai = free_ports(4)
    env = os.environ | TINY_ENV | {"LORA_LLM_MODEL_DIR": str(tiny_chat_model_dir)}
    launcher = subprocess.Popen([sys.executable, "-u", ROOT / "scripts" / "launch_server.py", "--http-port", str(http),
                                 "--grpc-port", str(grpc), "--metrics-port", str(metrics), "--models", "lora_llm",
                                 "--openai-port", str(openai), "--host", "0.0.0.0"], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True)
    lines: list[str] = []
    try:
        read_until(launcher, "openai ready", lines)
        assert listening_addresses(grpc) == {"0100007F"}, "tritonserver stays on loopback without --expose-core"
        assert listening_addresses(openai) == {"00000000"}
        children = descendants(launcher.pid)
        launcher.kill()
        launcher.wait(timeout=10)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(listening_addresses(p) for p in (http, grpc, metrics, openai)):
            time.sleep(0.2)
        assert not any(listening_addresses(p) for p in (http, grpc, metrics, openai))
        while time.monotonic() < deadline and [p for p in children if running(p)]:
            time.sleep(0.2)
        assert [p for p in children if running(p)] == []
    finally:
        launcher.kill()
        for pid in descendants(launcher.pid):
            os.kill(pid, signal.SIGKILL)


def requests_answered(metrics_port: int) -> float:
    """Every request model.py answered (lora_llm_requests_total over its outcomes)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("lora_llm_requests_total{"))


def test_exposed_ports_ask_for_the_key_and_our_own_clients_send_it(tiny_chat_model_dir, monkeypatch):
    """--expose-core: without the key nothing reaches model.py (gRPC and HTTP inference, the repository API); with it
    our client, perf_analyzer, the OpenAI API and the engine's own reload after a stub died all get through."""
    from client.grpc_client import LoraLLMClient
    from tests.server.test_health import LIES, served_again, status_of
    from tests.server.streams import send_lie
    key = "k3y-" + "x" * 28
    [openai] = free_ports(1)
    launcher, grpc = start_launcher(tiny_chat_model_dir, "--expose-core", "--openai-port", str(openai),
                                    settings=TINY_ENV | {"LORA_LLM_CORE_KEY": key})
    url, http, lines = f"127.0.0.1:{grpc}", launcher.http_port, []
    try:
        read_until(launcher, "openai ready", lines)
        answered = requests_answered(launcher.metrics_port)
        refused = run(url, trtllm_inputs([5, 6, 7], 4, True))
        assert "restricted" in (refused.error or ""), refused.error
        http_infer = {"inputs": [{"name": "input_ids", "shape": [1, 3], "datatype": "INT32", "data": [5, 6, 7]}]}
        assert status_of(f"http://127.0.0.1:{http}/v2/models/lora_llm/infer", http_infer)[0] == 403
        assert status_of(f"http://127.0.0.1:{http}/v2/repository/models/lora_llm/load", {})[0] == 403
        assert requests_answered(launcher.metrics_port) == answered, "a request without the key reached model.py"
        assert status_of(f"http://127.0.0.1:{http}/v2/health/ready")[0] == 200          # probes need no key

        monkeypatch.setenv("LORA_LLM_CORE_KEY", key)
        client = LoraLLMClient(url)
        tokens = [t for chunk in client.generate([5, 6, 7], 4) for t in chunk]
        client.close()
        assert len(tokens) == 4
        body = {"model": tiny_chat_model_dir.name, "prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0}
        assert status_of(f"http://127.0.0.1:{openai}/v1/completions", body)[0] == 200
        pa = subprocess.run([sys.executable, ROOT / "scripts" / "run_perf_analyzer.py", "--url", url, "--requests", "4",
                             "--concurrency", "1", "--vocab-size", "512", "--output-len", "4"],
                            capture_output=True, text=True, timeout=300, env=os.environ | {"LORA_LLM_CORE_KEY": key})
        assert pa.returncode == 0, pa.stdout[-2000:] + pa.stderr[-1000:]

        metadata = {"triton-grpc-protocol-lora-llm-key": key}
        name, datatype, shape, _ = LIES["input_ids INT32 [1, 2**62]"]
        assert send_lie(url, name, datatype, shape, headers=metadata)
        took, _, again = served_again(url, trtllm_inputs([5, 6, 7], 4, True), launcher.metrics_port,
                                      headers=metadata)
        assert again.tokens == tokens and not any("tritonserver died" in line for line in lines), took
    finally:
        launcher.terminate()
        assert launcher.wait(timeout=60) == 0


def test_the_back_off_grows_and_starts_over_after_a_minute_ready():
    """The supervisor's restart delays: 1, 2, 4 s for deaths soon after each start, at once (and from 1 s again)
    after a minute ready."""
    from supervisor import STABLE_S, Service

    class Process:
        pid, code = 1 << 30, None                     # (no such process group)

        def poll(self):
            return self.code

    started: list[Process] = []
    service = Service("fake", start=lambda: started.append(Process()) or started[-1], ready=lambda p: True,
                      on_ready=lambda restarts: None, log=lambda line: None)
    service.launch()
    now, delays = 0.0, []

    def run_then_die(ready_for_s: float) -> None:
        nonlocal now
        service.poll(now)                             # ready
        now += ready_for_s
        started[-1].code = 1
        service.poll(now)                             # dead: the next start is due after the delay
        delays.append(service.restart_at - now)
        now = service.restart_at
        service.poll(now)                             # started again

    for ready_for_s in (5, 5, 5, STABLE_S + 1, 5, 5):
        run_then_die(ready_for_s)
    assert delays == [1, 2, 4, 0, 1, 2] and len(started) == 7
