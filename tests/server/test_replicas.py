"""scripts/replicas.py: two replicas behind nginx. With consistent hashing on the adapter, each of 12 adapters is
uploaded to exactly one replica (read from each replica's own metrics); with nginx's round-robin, most of them to
both."""
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

from backend.lora.peft import save_trtllm
from tests.helpers import ROOT
from tests.server.conftest import TINY_ENV, free_ports

pytestmark = [pytest.mark.slow, pytest.mark.skipif(shutil.which("nginx") is None and not os.path.exists(
    "/usr/sbin/nginx"), reason="needs nginx (Debian nginx-light: scripts/test.sh installs it where apt-get can)")]
NUM_ADAPTERS = 12
REQUESTS_PER_ADAPTER = 3


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """12 small random adapters on the tiny model's q projection (hidden 64), TensorRT-LLM files."""
    root = tmp_path_factory.mktemp("store")
    rng = np.random.default_rng(0)
    for i in range(NUM_ADAPTERS):
        weights = (rng.standard_normal((2, 4 * 64 * 2)) * 0.05).astype(np.float16)
        save_trtllm(root / f"adapter{i:02d}", weights, np.array([[1, 0, 4], [1, 1, 4]], np.int32))
    return root


def get(url: str, body: dict | None = None) -> bytes:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    return urllib.request.urlopen(request, timeout=60).read()


def uploads_per_replica(balance: str, model_dir, store) -> list[dict[str, float]]:
    """Start two replicas behind nginx, send 3 requests for each adapter through nginx (a round over the adapters at
    a time, each round shifted by one: in a fixed order, round-robin would give each adapter the same replica every
    round), read each replica's uploads."""
    # each call its own ports: a replica of the call before may still be letting go of its own
    # (below 32768: Linux hands ports from there up to outgoing connections, which may take one first)
    port, base = free_ports(1)[0], 20000 + (os.getpid() % 300) * 40 + (balance == "hash") * 20
    env = os.environ | TINY_ENV
    process = subprocess.Popen([sys.executable, "-u", str(ROOT / "scripts" / "replicas.py"), "--replicas", "2",
                                "--port", str(port), "--base-port", str(base), "--balance", balance, "--model-dir",
                                str(model_dir), "--adapter-store", str(store), "--", "--models", "lora_llm"],
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    try:
        ready = 0
        for line in process.stdout:
            lines.append(line)
            ready += "[replicas] replica" in line and " ready:" in line
            if ready == 2:
                break
        assert ready == 2, "replicas did not start:\n" + "".join(lines[-40:])
        threading.Thread(target=lambda: lines.extend(process.stdout), daemon=True).start()   # the log, if needed
        time.sleep(0.5)
        for r in range(REQUESTS_PER_ADAPTER):
            for i in np.roll(np.arange(NUM_ADAPTERS), r):         # each round in another order
                try:
                    answer = json.loads(get(f"http://127.0.0.1:{port}/v1/completions",
                                            {"model": f"adapter{i:02d}", "prompt": [5, 6, 7], "max_tokens": 2}))
                except urllib.error.HTTPError as err:
                    raise AssertionError(f"adapter{i:02d}: {err.code} {err.read()[:500]!r}\n"
                                         + "".join(lines[-60:])) from err
                assert 1 <= answer["usage"]["completion_tokens"] <= 2       # sampled: the end token may come first
        counts = []
        for r in range(2):
            text = get(f"http://127.0.0.1:{base + 10 * r + 3}/metrics").decode()
            counts.append({line.split('"')[1]: float(line.split()[-1]) for line in text.splitlines()
                           if line.startswith("lora_llm_openai_adapter_uploads_total{")})
        return counts
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=90)


def test_consistent_hashing_keeps_each_adapter_on_one_replica(tiny_chat_model_dir, store):
    counts = uploads_per_replica("hash", tiny_chat_model_dir, store)
    for i in range(NUM_ADAPTERS):
        name = f"adapter{i:02d}"
        assert sorted(c.get(name, 0) for c in counts) == [0, 1], (name, counts)
    assert all(counts), "both replicas serve some adapters"


def test_round_robin_uploads_most_adapters_to_every_replica(tiny_chat_model_dir, store):
    counts = uploads_per_replica("round-robin", tiny_chat_model_dir, store)
    on_both = [i for i in range(NUM_ADAPTERS) if all(c.get(f"adapter{i:02d}", 0) >= 1 for c in counts)]
    assert len(on_both) >= NUM_ADAPTERS * 3 // 4, counts
