"""scripts/launch_server.py supervises tritonserver: killed with SIGKILL, it is logged and started again, and
serves the same tokens as before; stopped, it ends tritonserver even where tritonserver would not end by itself."""
import os
import signal
import subprocess
import sys

import pytest

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
