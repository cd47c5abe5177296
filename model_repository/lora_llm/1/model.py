"""Triton Python backend adapter for the engine: tensors in, backend requests out, responses back.

No scheduling, model math or LoRA parsing here: `execute` parses and enqueues, then returns at once; the
engine loop thread (backend/serving.py) steps the engine and answers through each request's sender.
"""
import gc
import json
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from backend import LLMEngine, RequestError                    # noqa: E402
from backend.protocol import (extra_arrays, generation_logits, merge_rows, output_arrays,   # noqa: E402
                              parse_request)
from backend.lora.cache import LoraCacheStats                 # noqa: E402
from backend.serving import EngineLoop                         # noqa: E402

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
INT_PARAMS = ("kv_cache_memory_bytes", "kv_block_size", "max_num_seqs", "max_num_batched_tokens", "max_lora_rank",
              "max_loras", "lora_cache_host_memory_bytes", "lora_cache_max_adapter_size", "max_queue_size",
              "max_words", "max_word_len", "cancellation_check_period_ms")
FLOAT_PARAMS = ("kv_cache_free_gpu_mem_fraction",)
BOOL_PARAMS = ("enable_kv_cache_reuse", "cuda_graph_mode")
INT_LIST_PARAMS = ("inject_fault_steps",)
PATH_PARAMS = ("model_dir", "lora_prefetch_dir", "tokenizer_dir")
LORA_STATS = LoraCacheStats.__slots__


def engine_kwargs(model_config: dict) -> dict:
    """Model parameters, each overridable by the environment variable LORA_LLM_<NAME>."""
    kwargs = {}
    for name, entry in model_config.get("parameters", {}).items():
        value = os.environ.get(f"LORA_LLM_{name.upper()}", entry["string_value"])
        if value == "":
            continue
        if name in INT_PARAMS:
            value = int(value)
        elif name in FLOAT_PARAMS:
            value = float(value)
        elif name in BOOL_PARAMS:
            value = value.lower() in ("true", "1")
        elif name in INT_LIST_PARAMS:
            value = tuple(int(v) for v in value.split(","))
        elif name in PATH_PARAMS and not os.path.isabs(value):
            value = str(ROOT / value)
        kwargs[name] = value
    return kwargs


def as_array(tensor) -> np.ndarray:
    try:
        return tensor.as_numpy()
    except Exception:                              # BF16 has no numpy dtype: go through torch
        from torch.utils.dlpack import from_dlpack
        return from_dlpack(tensor.to_dlpack()).float().numpy()


class TritonStream:
    """One Triton request's response sender, for all its rows and sequences; never touched after its final
    response (the lock keeps a question from another thread off a final send in progress). Streaming rows answer
    each step's new tokens, the others each sequence's whole output."""

    def __init__(self, request, rows, metrics: "Metrics", unary: bool = False):
        self.requests = rows
        self.unary = unary                         # not decoupled: every row's output in one response
        self.held: dict[int, dict[str, np.ndarray]] = {}                          # unary rows done so far
        self.sender = request.get_response_sender()
        self.metrics = metrics
        self.start = time.perf_counter()
        self.outputs: dict[tuple[int, int], tuple[list[int], list[float]]] = {}   # (batch, sequence) -> so far
        self.logits: dict[tuple[int, int], list[np.ndarray]] = {}                # generation logits, if asked
        self.context_logits: dict[int, np.ndarray] = {}                           # batch index -> [prompt, vocab]
        self.done = False
        self.lock = threading.Lock()

    def is_cancelled(self) -> bool:
        with self.lock:
            return not self.done and self.sender.is_cancelled()

    def emit(self, out, batch_index: int, last: bool) -> None:
        if self.done:
            return
        if not self.outputs:
            self.metrics.observe("ttft", time.perf_counter() - self.start)
        row = self.requests[batch_index]
        tokens, log_probs = self.outputs.setdefault((batch_index, out.sequence_index), ([], []))
        tokens += out.new_token_ids
        log_probs += out.log_probs
        if out.context_logits is not None:
            self.context_logits[batch_index] = out.context_logits.numpy()[None]     # [1, prompt_len, vocab]
        logits = self.logits.setdefault((batch_index, out.sequence_index), [])
        if out.generation_logits is not None:
            logits.append(out.generation_logits.numpy())
        context = {"context_logits": self.context_logits.pop(batch_index)} if out.sequence_index == 0 and \
            batch_index in self.context_logits and (row.streaming or out.finished) else {}
        if row.streaming and (out.new_token_ids or last):
            arrays = output_arrays(out.new_token_ids, out.log_probs) | context
            self._send(arrays | generation_logits(logits[-len(out.new_token_ids):] if out.new_token_ids else [],
                                                  row), last, row, batch_index, out, len(tokens))
        elif not row.streaming and out.finished:
            prompt = [] if row.exclude_input_in_output else row.prompt_ids
            arrays = output_arrays(prompt + tokens, [0.0] * len(prompt) + log_probs) | context
            self._send(arrays | generation_logits(logits, row), last, row, batch_index, out, len(tokens))
        if last:
            self.metrics.count("success")

    def fail(self, message: str) -> None:
        with self.lock:
            if self.done:
                return
            self.done = True
            self.sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(message)), flags=FINAL)
        self.metrics.count("failure")

    def acknowledge(self) -> None:
        """The final, empty response to a `stop` request."""
        self._send(output_arrays([], []), True)

    def cancelled(self) -> None:
        if not self.done:
            row = self.requests[0]
            tokens, log_probs = ([], []) if row.streaming else self.outputs.get((0, 0), ([], []))
            self._send(output_arrays(tokens, log_probs if tokens else []), True)
            self.metrics.count("cancelled")

    def _send(self, arrays: dict, final: bool, row=None, batch_index: int = 0, out=None, num_tokens: int = 0):
        if row is not None:
            arrays |= extra_arrays(row, len(self.requests), batch_index, out.sequence_index, out.metrics, num_tokens)
        if self.unary and len(self.requests) > 1:
            self.held[batch_index] = arrays
            if not final:
                return
            arrays = merge_rows([self.held[b] for b in sorted(self.held)])
        response = pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(k, v) for k, v in arrays.items()])
        with self.lock:
            self.done = final
            self.sender.send(response, flags=FINAL if final else 0)


class Metrics:
    """pb_utils metric families, updated under one lock (concurrent updates crash tritonserver 2.51). Each update is
    a round trip to tritonserver (~45 us on 2 busy cores), so a step sends only the gauges that changed, and the
    generated tokens once per step (the engine's count): 18 updates a step were 0.8 ms of a 33 ms single-stream decode
    step."""

    def __init__(self):
        self.lock = threading.Lock()
        fam = pb_utils.MetricFamily
        self.families = [
            requests := fam("lora_llm_requests_total", "Finished requests by outcome", fam.COUNTER),
            tokens := fam("lora_llm_generated_tokens_total", "Generated tokens", fam.COUNTER),
            seqs := fam("lora_llm_sequences", "Sequences by state", fam.GAUGE),
            blocks := fam("lora_llm_kv_blocks", "Paged KV cache blocks by state", fam.GAUGE),
            lora := fam("lora_llm_lora_cache", "LoRA cache counters and bytes per tier", fam.GAUGE),
            ttft := fam("lora_llm_time_to_first_token_seconds", "Time to first token", fam.HISTOGRAM),
            step := fam("lora_llm_step_seconds", "Engine step latency, by kind: decode, or prefill (the step holds "
                        "prompt tokens)", fam.HISTOGRAM),
            alive := fam("lora_llm_engine_alive", "1 while the engine loop serves requests, 0 once it cannot",
                         fam.GAUGE),
            reuse := fam("lora_llm_kv_cache_reuse", "KV cache reuse: prompt blocks looked up, found, and the hit rate",
                         fam.GAUGE),
        ]
        buckets = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]
        self.counters = {s: requests.Metric(labels={"status": s}) for s in ("success", "failure", "cancelled")}
        self.counters["tokens"] = tokens.Metric(labels={})
        self.gauges = {f"seqs_{s}": seqs.Metric(labels={"state": s}) for s in ("running", "waiting")}
        self.gauges |= {f"kv_{s}": blocks.Metric(labels={"state": s}) for s in ("used", "free")}
        self.gauges |= {f"reuse_{s}": reuse.Metric(labels={"stat": s}) for s in ("lookups", "hits", "hit_rate")}
        self.gauges |= {f"lora_{name}": lora.Metric(labels={"tier": name.split("_")[0], "stat": name.split("_", 1)[1]})
                        for name in LORA_STATS}
        self.gauges["alive"] = alive.Metric(labels={})
        self.shown: dict[str, float] = {}                  # what each gauge was last set to
        self.num_tokens_shown = 0                          # the token counter's value
        self.histograms = {"ttft": ttft.Metric(labels={}, buckets=buckets)}
        self.histograms |= {f"step_{kind}": step.Metric(labels={"kind": kind}, buckets=buckets)
                            for kind in ("decode", "prefill")}

    def count(self, name: str, value: int = 1) -> None:
        with self.lock:
            if self.families:
                self.counters[name].increment(value)

    def observe(self, name: str, value: float) -> None:
        with self.lock:
            if self.families:
                self.histograms[name].observe(value)

    def close(self) -> None:
        """Frees every metric while the stub still talks to the server: freed at interpreter exit, they crash it."""
        with self.lock:
            self.families, self.counters, self.gauges, self.histograms = [], {}, {}, {}
            gc.collect()

    def on_step(self, engine: LLMEngine, seconds: float | None, alive: bool = True) -> None:
        """After a step, before its responses (seconds: its latency), or after a change without one (None)."""
        stats = engine.stats()
        lookups, hits = stats["kv_reuse_lookups"], stats["kv_reuse_hits"]
        values = {name: stats[name] for name in ("seqs_running", "seqs_waiting", "kv_used", "kv_free")}
        values |= {"reuse_lookups": lookups, "reuse_hits": hits, "reuse_hit_rate": hits / lookups if lookups else 0.0}
        values |= {f"lora_{name}": stats["lora"][name] for name in LORA_STATS} | {"alive": 1 if alive else 0}
        with self.lock:
            if not self.families:
                return
            if seconds is not None:
                self.histograms[f"step_{engine.last_step_kind}"].observe(seconds)
            if stats["tokens_generated"] > self.num_tokens_shown:
                self.counters["tokens"].increment(stats["tokens_generated"] - self.num_tokens_shown)
                self.num_tokens_shown = stats["tokens_generated"]
            for name, value in values.items():
                if self.shown.get(name) != value:
                    self.gauges[name].set(value)
                    self.shown[name] = value


def check_unary(rows) -> None:
    """Without decoupled mode a request gets exactly one response: its rows' outputs together, not streamed."""
    if any(row.streaming for row in rows):
        raise RequestError("streaming", "streaming is only supported in decoupled mode")
    if any(row.params.num_return_sequences > 1 for row in rows):
        raise RequestError("num_return_sequences", "several sequences of a prompt need decoupled mode (one "
                                                   "response each)")


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(config)
        self.metrics = Metrics()
        kwargs = engine_kwargs(config)
        check_period_ms = kwargs.pop("cancellation_check_period_ms", 100)
        self.engine = LLMEngine(**kwargs)
        self.loop = EngineLoop(self.engine, on_step=self._on_step, cancellation_check_period_s=check_period_ms / 1e3)
        self._on_step(self.engine, None)

    def _on_step(self, engine: LLMEngine, seconds: float | None) -> None:
        self.metrics.on_step(engine, seconds, alive=getattr(self, "loop", None) is None or self.loop.alive)

    def execute(self, requests):
        for request in requests:                   # every request is answered, whatever happens to the others
            try:
                self._accept(request)
            except RequestError as err:
                TritonStream(request, [], self.metrics).fail(str(err))
            except Exception as err:
                TritonStream(request, [], self.metrics).fail(f"request failed: {type(err).__name__}: {err}")
        return None

    def _accept(self, request) -> None:
        rows = parse_request({t.name(): as_array(t) for t in request.inputs()}, self.engine.limits)
        if not self.decoupled:
            check_unary(rows)
        stream = TritonStream(request, rows, self.metrics, unary=not self.decoupled)
        if rows[0].stop:
            self._stop(request.request_id(), stream)
        else:
            self.loop.submit(stream, request.request_id())

    def _stop(self, name: str, stream: TritonStream) -> None:
        if not name:
            stream.fail("A request id must be provided for request cancellation")
            return
        self.loop.cancel(name)
        stream.acknowledge()

    def finalize(self):
        self.loop.stop()
        self.metrics.close()
