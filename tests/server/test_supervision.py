"""scripts/launch_server.py supervises tritonserver and the OpenAI API: each killed with SIGKILL is logged and started
again on its own, and serves as before; stopped, it ends tritonserver even where tritonserver would not end by
itself."""
import json
import os
import signal
import subprocess
import sys
import urllib.request

import pytest
from transformers import AutoTokenizer

from tests.helpers import ROOT, random_prompts
from tests.server.conftest import TINY_ENV, free_ports
from tests.server.streams import Stream, run, trtllm_inputs


def start_launcher(tiny_model_dir, *args: str) -> tuple[subprocess.Popen, int]:
    """launch_server.py on free ports with the tiny model, lora_llm only: the launcher and its gRPC port."""
    http, grpc, metrics = free_ports(3)
    env = os.environ | TINY_ENV | {"LORA_LLM_MODEL_DIR": str(tiny_model_dir)}
    launcher = subprocess.Popen([sys.executable, "-u", ROOT / "scripts" / "launch_server.py", "--http-port", str(http),
                                 "--grpc-port", str(grpc), "--metrics-port", str(metrics), "--models", "lora_llm",
                                 *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    return launcher, grpc




def read_until(process: subprocess.Popen, marker: str, lines: list[str]) -> str:
    for line in process.stdout:
        lines.append(line)
        if marker in line:
            return line
    raise AssertionError(f"launcher ended before {marker!r}:\n{''.join(lines)[-3000:]}")


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
        assert "killing it" in launcher.stdout.read()
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    finally:
        if stream is not None:
            stream.close()
        launcher.kill()
        launcher.wait(timeout=60)


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
