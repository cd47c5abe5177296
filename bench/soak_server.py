"""The server a soak runs against: scripts/launch_server.py (which restarts tritonserver when it dies) on free
ports, a small KV pool and host adapter budget, and what the soak reads from it (metrics, RSS, restarts)."""
import os
import re
import subprocess
import sys
import threading
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

from server_process import QUICK_EXIT_TIMEOUT_S

ROOT = Path(__file__).resolve().parent.parent
UPSTREAM_ABORTS = ("proto_buffer_writer.h:65 ASSERTION FAILED", "sync.cc:105 ASSERTION FAILED: prior > 0",
                   "GRPC_CALL_ERROR_TOO_MANY_OPERATIONS",    # tritonserver 2.51's own gRPC aborts, and its gRPC
                   "a call into tritonserver (a response or a cancellation check) has run")  # frontend's deadlock
                                                             # (docs/reliability.md)
UPSTREAM_DEATH = re.compile(r"tritonserver died \(killed by SIG(SEGV|ABRT|BUS|ILL|FPE)\)|Signal \((4|6|7|8|11)\) "
                            r"received")                    # a fault in its own process (its handler's line, where
                                                             # that handler hung): our code runs in the stub's and the
                                                             # engine's


class SoakServer:
    def __init__(self, args, cfg, ports: list[int]):
        self.http_port, self.grpc_port, self.metrics_port = ports
        kv_block_bytes = 2 * cfg.num_layers * 16 * cfg.kv_size * 4                  # fp32 worst case
        self.host_budget = args.host_memory_mb << 20
        self.env = os.environ | {
            "LORA_LLM_MODEL_DIR": str(Path(args.model_dir).resolve()), "LORA_LLM_KV_BLOCK_SIZE": "16",
            "LORA_LLM_KV_CACHE_MEMORY_BYTES": str(args.kv_blocks * kv_block_bytes),
            "LORA_LLM_MAX_LORAS": str(args.max_loras),
            "LORA_LLM_MAX_LORA_RANK": "16", "LORA_LLM_LORA_CACHE_HOST_MEMORY_BYTES": str(self.host_budget),
            "LORA_LLM_MAX_NUM_SEQS": "64"}
        self.lines: list[str] = []
        self.ready = threading.Event()

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def __enter__(self) -> "SoakServer":
        self.launcher = subprocess.Popen(
            [sys.executable, "-u", str(ROOT / "scripts" / "launch_server.py"), "--http-port", str(self.http_port),
             "--grpc-port", str(self.grpc_port), "--metrics-port", str(self.metrics_port), "--models", "lora_llm",
             "--exit-timeout-s", str(QUICK_EXIT_TIMEOUT_S)],
            env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        threading.Thread(target=self._read, daemon=True).start()
        if not self.ready.wait(300):
            self.launcher.terminate()
            raise RuntimeError("server not ready:\n" + "".join(self.lines[-40:]))
        return self

    def __exit__(self, *exc) -> None:
        self.launcher.terminate()
        self.launcher.wait(timeout=60)

    @contextmanager
    def log_on_failure(self, num_lines: int = 80):
        """An exception inside (the server gone, a figure missing) prints the launcher's and the server's last lines
        first: what a failed soak needs to be understood."""
        try:
            yield
        except Exception:
            print(f"soak: failed; tritonserver restarts {self.restarts()}; the server's last lines:\n"
                  + "".join(self.lines[-num_lines:]), file=sys.stderr, flush=True)
            raise

    def _read(self) -> None:
        for line in self.launcher.stdout:
            self.lines.append(line)
            if line.startswith("ready:") or "ready again" in line:
                self.ready.set()

    def restarts(self) -> int:
        return sum("tritonserver died" in line for line in self.lines)

    def upstream_aborts(self) -> list[str]:
        """The log lines that say tritonserver failed in its own code: its 2.51 gRPC aborts and deadlock, or its
        process dying of a fault signal."""
        return [line.strip() for line in self.lines
                if any(abort in line for abort in UPSTREAM_ABORTS) or UPSTREAM_DEATH.search(line)]

    def restart_lines(self) -> list[str]:
        """The supervisor's lines on each death or kill of tritonserver, and why."""
        return [line.strip() for line in self.lines if "tritonserver died" in line or "cannot serve" in line]

    def server_pid(self) -> int:
        line = next(line for line in reversed(self.lines) if "tritonserver pid" in line)
        return int(re.search(r"pid (\d+)", line)[1])

    def rss_bytes(self) -> int:
        """Resident memory of tritonserver and its children (the Python backend stubs)."""
        return sum(self.rss_by_process().values())

    def rss_by_process(self) -> dict[str, int]:
        """Resident bytes of tritonserver and of each child apart (a stub by its model's name)."""
        root, out = self.server_pid(), {}
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                pid, fields = int(stat.parent.name), stat.read_text().rsplit(")", 1)[1].split()
                if pid != root and int(fields[1]) != root:
                    continue
                status = Path(f"/proc/{pid}/status").read_text()
                rss = int(re.search(r"VmRSS:\s+(\d+) kB", status)[1]) * 1024
                cmdline = Path(f"/proc/{pid}/cmdline").read_text().split("\0")
            except (OSError, ValueError, IndexError, TypeError):
                continue
            stub = next((Path(arg).parent.parent.name for arg in cmdline if arg.endswith("model.py")), None)
            out["tritonserver" if pid == root else f"stub {stub or pid}"] = rss
        return out

    def metric(self, name: str, **labels) -> float:
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).read().decode()
        for line in text.splitlines():
            if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(f"{name}{labels}")

    def settled_figures(self, timeout_s: float = 120) -> dict:
        """Once nothing runs or waits: KV blocks in use, adapter pins, host adapter bytes vs budget, liveness."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                in_flight = self.metric("lora_llm_sequences", state="running") + self.metric("lora_llm_sequences",
                                                                                            state="waiting")
            except (OSError, KeyError):                             # tritonserver restarting
                in_flight = None
            if in_flight == 0:
                break
            time.sleep(0.5)
        return {"kv_blocks_used": self.metric("lora_llm_kv_blocks", state="used"),
                "adapter_pins": self.metric("lora_llm_lora_cache", tier="device", stat="pins"),
                "host_adapter_bytes": self.metric("lora_llm_lora_cache", tier="host", stat="bytes"),
                "host_adapter_budget": self.host_budget, "engine_alive": self.metric("lora_llm_engine_alive")}
