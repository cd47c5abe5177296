"""Soak a real server: many concurrent gRPC streams for a while, random lengths, many adapters through few device
slots (weights sent on first use, again when evicted), a share of streams cancelled mid-way, a small KV pool that
forces preemption, a few adversarial requests. Reports whether every request was answered and nothing leaked.

    python scripts/soak.py [--streams 256] [--duration 600] [--adapters 128] [--max-loras 8] [--model-dir DIR]
        [--out FILE.json]
Starts its own server (scripts/launch_server.py, which restarts tritonserver if it dies: restarts are reported).
Exit status 1 if a request went unanswered, or KV blocks or adapter pins are left at the end.
"""
import argparse
import json
import random
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from statistics import mean

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

from backend.lora.format import module_shape                      # noqa: E402
from backend.model.checkpoint import ModelConfig                        # noqa: E402
from client.grpc_client import NOT_FOUND, build_inputs            # noqa: E402
from server_process import free_ports                              # noqa: E402
from bench.soak_server import SoakServer                          # noqa: E402

# A stream is cancelled at least this many tokens before its last: tritonserver 2.51 can crash when a client's cancel
# meets the stream's final response (triton-inference-server/server#7368, docs/reliability.md), which the soak, here
# to find our leaks, would report as a restart. tests/server/test_stream_abort.py plays such sequences. The client
# counts the tokens it has received, and on 2 busy cores (the suite's other worker compiling) the server runs several
# steps ahead of what has arrived: with 4, 2 of 6 soaks beside other test modules crashed it (a SIGSEGV in
# TRITONBACKEND_OutputBuffer, gRPC's call_op_set assertion) and one left a request unanswered.
CANCEL_MARGIN = 8


def make_adapter(cfg: ModelConfig, rank: int, seed: int, scale: float = 0.02) -> tuple[np.ndarray, np.ndarray]:
    """Random TensorRT-LLM tensors on q, v, down of every layer (fp16, clipped to its finite range)."""
    rng = np.random.default_rng(seed)
    rows, config = [], []
    for layer in range(cfg.num_layers):
        for module_id in (1, 3, 6):
            in_dim, out_dim = module_shape(cfg, module_id)
            rows.append(np.clip(rng.normal(0, scale, rank * (in_dim + out_dim)), -6e4, 6e4))
            config.append([module_id, layer, rank])
    weights = np.zeros((len(rows), max(len(r) for r in rows)), dtype=np.float16)
    for i, row in enumerate(rows):
        weights[i, :len(row)] = row
    return weights, np.array(config, dtype=np.int32)


class Soak:
    def __init__(self, args, cfg: ModelConfig, url: str):
        self.args, self.cfg, self.url = args, cfg, url
        self.adapters = [make_adapter(cfg, (4, 8, 16)[t % 3], t) for t in range(args.adapters)]
        self.sent_weights: set[int] = set()
        self.lock = threading.Lock()
        self.outcomes: Counter = Counter()     # answered: finished / error kinds / cancelled by the client
        self.num_sent = 0
        self.num_tokens = 0
        self.weight_bytes_in_flight = 0        # adapter weights of the requests sent and not yet answered

    def request(self, rng: random.Random) -> tuple[dict, str]:
        """One random request's inputs and its kind."""
        prompt = [rng.randrange(3, self.cfg.vocab_size) for _ in range(rng.randint(4, self.args.max_prompt))]
        kwargs = dict(input_ids=prompt, max_tokens=rng.randint(1, self.args.max_output))
        roll = rng.random()
        if roll < 0.02:                        # adversarial: absurd (finite) adapter weights drive activations to inf
            weights, config = make_adapter(self.cfg, 4, 10_000 + rng.randrange(1000), scale=3e3)
            task_id = 10_000 + rng.randrange(1_000_000)
            return kwargs | dict(lora_task_id=task_id, lora_weights=weights, lora_config=config), "adversarial"
        if roll < 0.04:
            return kwargs | dict(temperature=float("nan"), runtime_top_k=5), "invalid"
        if roll < 0.15:
            return kwargs, "base"
        task_id = rng.randrange(len(self.adapters))
        return kwargs | dict(lora_task_id=task_id + 1), "lora"

    def worker(self, seed: int, deadline: float) -> None:
        import tritonclient.grpc as grpcclient
        rng = random.Random(seed)
        client = grpcclient.InferenceServerClient(self.url)
        try:
            while time.monotonic() < deadline:
                kwargs, kind = self.request(rng)
                cancel_after = None
                if rng.random() < self.args.cancel_share and kwargs["max_tokens"] > CANCEL_MARGIN:
                    cancel_after = rng.randint(0, min(8, kwargs["max_tokens"] - CANCEL_MARGIN))
                self.run_one(client, kwargs, cancel_after)
                if self.args.connection_per_request:
                    client.close()
                    client = grpcclient.InferenceServerClient(self.url)
        finally:
            client.close()

    def run_one(self, client, kwargs: dict, cancel_after: int | None, retry: bool = True) -> None:
        import queue

        from tritonclient.utils import InferenceServerException
        task_id = kwargs.get("lora_task_id")
        if task_id is not None and "lora_weights" not in kwargs and task_id not in self.sent_weights:
            kwargs = kwargs | dict(zip(("lora_weights", "lora_config"), self.adapters[task_id - 1]))
        responses: queue.Queue = queue.Queue()
        client.start_stream(callback=lambda result, error: responses.put((result, error)))
        weight_bytes = kwargs["lora_weights"].nbytes if "lora_weights" in kwargs else 0
        with self.lock:
            self.num_sent += 1
            self.weight_bytes_in_flight += weight_bytes
        outcome, received, accepted = "unanswered", 0, False
        try:
            client.async_stream_infer("lora_llm", build_inputs(**kwargs), enable_empty_final_response=True)
            while True:
                if cancel_after is not None and received >= cancel_after:
                    outcome = "cancelled by client"
                    break
                try:
                    result, error = responses.get(timeout=self.args.request_timeout)
                except queue.Empty:
                    break
                if error is not None:
                    outcome = "error: " + error_kind(str(error))
                    break
                ids = result.as_numpy("output_ids")
                received += 0 if ids is None else ids.size
                accepted = True
                if result.get_response().parameters["triton_final_response"].bool_param:
                    outcome = "finished"
                    break
        except InferenceServerException as err:         # the stream broke as the request went (a server restart)
            outcome = "error: " + error_kind(str(err))
            time.sleep(0.2)                               # (not a tight loop of such errors while it is down)
        finally:                       # (a stream left unanswered is cancelled too: closing it would wait for it)
            client.stop_stream(cancel_requests=outcome in ("cancelled by client", "unanswered"))
        with self.lock:
            self.weight_bytes_in_flight -= weight_bytes
            self.outcomes[outcome] += 1
            self.num_tokens += received
            if accepted and "lora_weights" in kwargs and task_id <= len(self.adapters):
                self.sent_weights.add(task_id)             # the server has it: later requests send the id only
        if outcome == "error: not found" and retry:                # evicted from the host tier: send the weights
            self.sent_weights.discard(task_id)
            self.run_one(client, kwargs, cancel_after, retry=False)


def error_kind(message: str) -> str:
    for key, kind in ((NOT_FOUND, "not found"), ("finite", "invalid input"), ("queue full", "queue full"),
                      ("engine failure", "engine failure"), ("lora_cache_host_memory_bytes", "host tier full"),
                      ("unavailable", "unavailable")):
        if key in message:
            return kind
    return message[:80]


def sample(server: SoakServer, soak: Soak, t: float) -> dict:
    """RSS per server process (MB), the host adapter tier, the adapter weights in flight (sent, not yet answered:
    tritonserver holds each request's message until its final response) and tritonserver less them."""
    rss = {k: round(v / 2**20) for k, v in server.rss_by_process().items()}
    in_flight = round(soak.weight_bytes_in_flight / 2**20)
    return {"t": round(t), **rss, "tritonserver_less_uploads_mb": rss["tritonserver"] - in_flight,
            "host_adapter_mb": round(server.metric("lora_llm_lora_cache", tier="host", stat="bytes") / 2**20),
            "weights_in_flight_mb": in_flight,
            **{state: server.metric("lora_llm_sequences", state=state) for state in ("running", "waiting")}}


def second_half_growth(samples: list[dict], duration_s: float, window_s: float | None = None) -> dict[str, float]:
    """Each server process's mean RSS over the last `window_s` of the load (a quarter of it by default) over its mean
    over the same span around the middle of the load, minus 1 (single samples swing with the uploads in flight;
    samples taken while the last requests drain come after the load, when memory may have been given back)."""
    window_s = duration_s / 4 if window_s is None else window_s
    under_load = [s for s in samples if s["t"] <= duration_s]
    if len(under_load) < 2:
        return {}
    end = under_load[-1]["t"]
    last = [s for s in under_load if s["t"] >= end - window_s]
    middle = [s for s in under_load if abs(s["t"] - end / 2) <= window_s / 2] or \
        [min(under_load, key=lambda s: abs(s["t"] - end / 2))]
    base = {name: mean(s[name] for s in middle) for name in under_load[-1]
            if name.startswith(("tritonserver", "stub", "weights"))}
    return {name: mean(s[name] for s in last) / value - 1 for name, value in base.items() if value > 0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--duration", type=float, default=600, help="seconds")
    parser.add_argument("--adapters", type=int, default=128)
    parser.add_argument("--max-loras", type=int, default=8)
    parser.add_argument("--cancel-share", type=float, default=0.3)
    parser.add_argument("--max-prompt", type=int, default=200)
    parser.add_argument("--max-output", type=int, default=64)
    parser.add_argument("--kv-blocks", type=int, default=64, help="KV pool in blocks of 16 tokens (forces preemption)")
    parser.add_argument("--host-memory-mb", type=int, default=256,
                        help="the host adapter tier's budget: below the adapters' total, so that it fills and evicts")
    parser.add_argument("--connection-per-request", action="store_true",
                        help="a new gRPC connection for each request (default: one per client thread for the run)")
    parser.add_argument("--request-timeout", type=float, default=600, help="seconds without a response: unanswered")
    parser.add_argument("--model-dir", default=str(ROOT / "models" / "smollm2-135m-instruct"))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    cfg = ModelConfig.from_dir(args.model_dir)
    with SoakServer(args, cfg, free_ports(3)) as server, server.log_on_failure():
        soak = Soak(args, cfg, server.grpc_url)
        start_rss = server.rss_bytes()
        start = time.monotonic()
        threads = [threading.Thread(target=soak.worker, args=(i, start + args.duration)) for i in range(args.streams)]
        for t in threads:
            t.start()
        samples = []                                                  # every 10 s: does memory plateau?
        while any(t.is_alive() for t in threads):
            if not samples or time.monotonic() - start >= samples[-1]["t"] + 10:
                try:
                    samples.append(sample(server, soak, time.monotonic() - start))
                except (OSError, KeyError):                        # tritonserver restarting: sampled next second
                    pass
            time.sleep(1)
        for t in threads:
            t.join()
        elapsed = time.monotonic() - start
        end = server.settled_figures()
        report = {"streams": args.streams, "seconds": elapsed, "requests_sent": soak.num_sent,
                  "requests_answered": sum(n for k, n in soak.outcomes.items() if k != "unanswered"),
                  "outcomes": dict(soak.outcomes), "tokens_per_s": soak.num_tokens / elapsed,
                  "server_rss_start_mb": start_rss / 2**20, "server_rss_end_mb": server.rss_bytes() / 2**20,
                  "restarts": server.restarts(), "upstream_aborts": server.upstream_aborts(),
                  "restart_lines": server.restart_lines(),
                  "server_rss_mb_samples": samples,
                  "rss_growth_second_half": second_half_growth(samples, args.duration), **end}
    print(json.dumps(report, indent=1))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    ok = (report["requests_answered"] == report["requests_sent"] and report["kv_blocks_used"] == 0
          and report["adapter_pins"] == 0)
    for name, growth in report["rss_growth_second_half"].items():
        print(f"{name} growth over the second half of the load: {100 * growth:+.1f}%")
    print("soak: " + ("passed" if ok else "FAILED: unanswered requests or leaked blocks/pins"))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
