"""scripts/launch_server.py supervises tritonserver: killed with SIGKILL, it is logged and started again, and
serves the same tokens as before."""
import os
import signal
import subprocess
import sys

from tests.helpers import ROOT, random_prompts
from tests.server.conftest import TINY_ENV, free_ports
from tests.server.streams import run, trtllm_inputs


def read_until(process: subprocess.Popen, marker: str, lines: list[str]) -> str:
    for line in process.stdout:
        lines.append(line)
        if marker in line:
            return line
    raise AssertionError(f"launcher ended before {marker!r}:\n{''.join(lines)[-3000:]}")


def test_a_killed_tritonserver_is_restarted_and_serves_the_same_tokens(tiny_model_dir):
    http, grpc, metrics = free_ports(3)
    env = os.environ | TINY_ENV | {"LORA_LLM_MODEL_DIR": str(tiny_model_dir)}
    launcher = subprocess.Popen([sys.executable, "-u", ROOT / "scripts" / "launch_server.py", "--http-port", str(http),
                                 "--grpc-port", str(grpc), "--metrics-port", str(metrics), "--models", "lora_llm"],
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
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
