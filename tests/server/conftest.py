"""Real tritonservers for the server tests: one on the tiny model (fp32, exact), one on SmolLM2 with the demo
adapters (text in, text out)."""
import re
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from backend import LLMEngine
from tests.helpers import ROOT

sys.path.append(str(ROOT / "scripts"))   # after the root: scripts/bench.py is not the bench package
from server_process import (QUICK_EXIT_TIMEOUT_S, free_ports, is_ready, start_frontend, start_server,  # noqa: E402
                           stop_server, wait_ready)


@dataclass
class Server:
    process: subprocess.Popen
    http_port: int
    grpc_port: int
    metrics_port: int
    env: dict
    log: Path

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def metric(self, name: str, **labels) -> float:
        """One sample from the metrics port, e.g. metric("lora_llm_kv_blocks", state="used") (other labels, such as
        the model and version every sample carries, may be there too)."""
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).read().decode()
        for line in text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                head, value = line.rsplit(" ", 1)
                if labels.items() <= dict(re.findall(r'(\w+)="([^"]*)"', head)).items():
                    return float(value)
        raise KeyError(f"{name}{labels} not in metrics")


def run_server(tmp_path_factory, name: str, env: dict, models: list[str] | None = None,
               model_repository: Path = ROOT / "model_repository"):
    http, grpc, metrics = free_ports(3)
    log = tmp_path_factory.mktemp(name) / "tritonserver.log"
    with open(log, "w") as log_file:
        process = start_server(http, grpc, metrics, model_repository, env=env, log_file=log_file, models=models,
                               exit_timeout_s=QUICK_EXIT_TIMEOUT_S)    # (the supervision tests check the
                                                                       # exit timeout with launchers of their own)
    try:
        wait_ready(process, http)
    except Exception:
        process.terminate()
        raise RuntimeError(f"tritonserver did not start:\n{log.read_text()[-4000:]}")
    server = Server(process, http, grpc, metrics, env, log)
    yield server
    stop_server(process, QUICK_EXIT_TIMEOUT_S)
    text = log.read_text()
    assert not any(crash in text for crash in ("Segmentation fault", "Segfault encountered", "signal 11"))


def engine_pid(http_port: int) -> int:
    """The engine process of the tritonserver on this port (backend/serving/engine_process.py)."""
    from backend.serving.heartbeat import engine_pids
    [pid] = engine_pids(http_port)
    return pid


TINY_ENV = {"LORA_LLM_DTYPE": "float32", "LORA_LLM_KERNEL_BACKEND": "torch", "LORA_LLM_KV_BLOCK_SIZE": "16",
            "LORA_LLM_KV_CACHE_MEMORY_BYTES": str(4 << 20), "LORA_LLM_MAX_LORAS": "4", "LORA_LLM_MAX_NUM_SEQS": "32"}


@pytest.fixture(scope="session")
def tiny_server(tmp_path_factory, tiny_model_dir):
    env = TINY_ENV | {"LORA_LLM_MODEL_DIR": str(tiny_model_dir)}
    yield from run_server(tmp_path_factory, "tiny-server", env, models=["lora_llm"])   # no tokenizer: no text models


@pytest.fixture(scope="session")
def new_tiny_engine(tiny_model_dir):
    """Makes a fresh in-process engine as the tiny server runs it, for reference outputs."""
    return lambda: LLMEngine(tiny_model_dir, dtype="float32", kernel_backend="torch", kv_block_size=16,
                             kv_cache_memory_bytes=4 << 20, max_loras=4)


@pytest.fixture(scope="session")
def smollm2_server(tmp_path_factory, smollm2_dir, demo_adapters):
    env = {"LORA_LLM_MODEL_DIR": str(smollm2_dir), "LORA_LLM_LORA_PREFETCH_DIR": str(demo_adapters),
           "LORA_LLM_KV_CACHE_MEMORY_BYTES": str(256 << 20)}
    yield from run_server(tmp_path_factory, "smollm2-server", env)


@dataclass
class Frontend:
    process: subprocess.Popen
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def run_frontend(tmp_path_factory, server: Server, model_dir: Path, *args: str):
    """The OpenAI-compatible API (python -m frontend) on a test server's core model, until the fixture ends."""
    [port] = free_ports(1)
    log = tmp_path_factory.mktemp("frontend") / "frontend.log"
    with open(log, "w") as log_file:
        process = start_frontend(model_dir, server.grpc_port, port, "--core-metrics-url",
                                 f"http://127.0.0.1:{server.metrics_port}/metrics", *args, log_file=log_file)
    deadline = time.monotonic() + 120
    while not is_ready(port, "/health"):
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"the OpenAI frontend did not start:\n{log.read_text()[-4000:]}")
        time.sleep(0.2)
    yield Frontend(process, port, log)
    process.terminate()
    process.wait(timeout=30)
