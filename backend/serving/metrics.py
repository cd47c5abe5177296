"""What a server reports about the engine, framework-free: our own `lora_llm_*` families, TensorRT-LLM's
`nv_trt_llm_*` (its backend's names, labels and meanings: the dashboards, autoscalers and the Kubernetes inference
gateway's endpoint picker written for it read them), and vLLM's `vllm:lora_requests_info` (the gateway's adapter
affinity). A server hands in a factory of its own metric families (Triton's pb_utils.MetricFamily)."""
import threading
import time
from dataclasses import dataclass, fields
from typing import Callable

from backend.lora.cache import LoraCacheStats
from backend.serving.heartbeat import HEARTBEAT

LORA_STATS = tuple(f.name for f in fields(LoraCacheStats))
LATENCY_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]
LORA_INFO = "vllm:lora_requests_info"
LORA_INFO_REFRESH_S = 1.0                     # its value is the time of its last update: refreshed this often
GAUGE_PERIOD_S = 0.1                          # gauges go out at most this often while steps run (TensorRT-LLM's
                                              # backend polls its stats every 100 ms), and whenever the engine idles


@dataclass(frozen=True)
class Family:
    name: str
    help: str
    kind: str                                 # "counter", "gauge" or "histogram"


FAMILIES = [Family(*spec) for spec in (
    ("lora_llm_requests_total", "Finished requests by outcome", "counter"),
    ("lora_llm_generated_tokens_total", "Generated tokens", "counter"),
    ("lora_llm_sequences", "Sequences by state", "gauge"),
    ("lora_llm_kv_blocks", "Paged KV cache blocks by state", "gauge"),
    ("lora_llm_lora_cache", "LoRA cache counters and bytes per tier", "gauge"),
    ("lora_llm_time_to_first_token_seconds", "Time to first token", "histogram"),
    ("lora_llm_step_seconds", "Engine step latency, by kind: decode, or prefill (the step holds prompt tokens)",
     "histogram"),
    ("lora_llm_engine_alive", "1 while the engine loop serves requests, 0 once it cannot", "gauge"),
    (HEARTBEAT, "Unix time of the engine's last heartbeat: renewed every half second while it can serve, stale once "
                "its stub process died or its loop is stuck", "gauge"),
    ("lora_llm_kernel_fallback", "1 for each kernel family the start-up self-check moved to the torch reference "
                                 "(attention, lora, fused) and for CUDA graphs turned off by it", "gauge"),
    ("lora_llm_kv_cache_reuse", "KV cache reuse: prompt blocks looked up, found, and the hit rate", "gauge"),
    ("nv_trt_llm_request_metrics", "TRT LLM request metrics", "gauge"),
    ("nv_trt_llm_kv_cache_block_metrics", "TRT LLM KV cache block metrics", "gauge"),
    ("nv_trt_llm_inflight_batcher_metrics", "TRT LLM inflight_batcher-specific metrics", "gauge"),
    ("nv_trt_llm_general_metrics", "General TRT LLM metrics", "gauge"),
    ("nv_trt_llm_runtime_memory_metrics", "TRT LLM runtime memory metrics", "gauge"),
    (LORA_INFO, "Running stats on LoRA requests (vLLM's): adapters in device memory and those waiting for it; "
                "the value is the time of the last update", "gauge"),
)]
TRTLLM_LABEL = {"nv_trt_llm_request_metrics": "request_type",
                "nv_trt_llm_kv_cache_block_metrics": "kv_cache_block_type",
                "nv_trt_llm_inflight_batcher_metrics": "inflight_batcher_specific_metric",
                "nv_trt_llm_general_metrics": "general_type", "nv_trt_llm_runtime_memory_metrics": "memory_type"}


def gauges(engine, alive: bool) -> dict[tuple[str, tuple], float]:
    """Every gauge's value now: (family, sorted label items) -> value."""
    stats, step, blocks = engine.stats(), engine.last_step, engine.blocks
    lookups, hits = stats["kv_reuse_lookups"], stats["kv_reuse_hits"]
    out = {("lora_llm_sequences", (("state", "running"),)): stats["seqs_running"],
           ("lora_llm_sequences", (("state", "waiting"),)): stats["seqs_waiting"],
           ("lora_llm_kv_blocks", (("state", "used"),)): stats["kv_used"],
           ("lora_llm_kv_blocks", (("state", "free"),)): stats["kv_free"],
           ("lora_llm_kv_cache_reuse", (("stat", "lookups"),)): lookups,
           ("lora_llm_kv_cache_reuse", (("stat", "hits"),)): hits,
           ("lora_llm_kv_cache_reuse", (("stat", "hit_rate"),)): hits / lookups if lookups else 0.0,
           ("lora_llm_engine_alive", ()): 1 if alive else 0}
    for kernel in ("attention", "lora", "lora_overlap", "lora_fold", "fused", "graphs", "piecewise_graphs",
                   "overlap_steps"):
        out[("lora_llm_kernel_fallback", (("kernel", kernel),))] = int(kernel in engine.runner.kernel_fallbacks)
    for name in LORA_STATS:
        tier, stat = name.split("_", 1)
        out[("lora_llm_lora_cache", (("stat", stat), ("tier", tier)))] = stats["lora"][name]
    trtllm = {
        "nv_trt_llm_request_metrics": {"active": stats["seqs_running"], "max": engine.config.max_num_seqs,
                                       "waiting": stats["seqs_waiting"], "scheduled": step.num_scheduled,
                                       "context": step.num_context},
        "nv_trt_llm_kv_cache_block_metrics": {"tokens_per": blocks.block_size, "used": stats["kv_used"],
                                              "free": stats["kv_free"], "max": blocks.num_blocks, "reused": hits,
                                              "fraction": stats["kv_used"] / blocks.num_blocks},
        "nv_trt_llm_inflight_batcher_metrics": {"total_context_tokens": step.num_context_tokens,
                                                "generation_requests": step.num_generation, "micro_batch_id": 0,
                                                "paused_requests": engine.scheduler.num_paused},
        "nv_trt_llm_general_metrics": {"iteration_counter": engine.num_steps, "timestamp": int(step.time)},
        "nv_trt_llm_runtime_memory_metrics": engine.runner.memory_bytes(engine.lora_cache),
    }
    for family, figures in trtllm.items():
        for kind, value in figures.items():
            out[(family, ((TRTLLM_LABEL[family], kind),))] = value
    return out


def lora_info(engine) -> dict[str, str]:
    """vLLM's LoRA info labels: the adapters resident in the device tier, and those of waiting requests that are
    not (by the name their requests gave, else the task id)."""
    cache = engine.lora_cache
    resident = set(cache.slot_of)
    waiting = {seq.lora_task_id for seq in engine.scheduler.waiting if seq.lora_task_id is not None} - resident
    return {"max_lora": str(cache.cfg.max_loras),
            "running_lora_adapters": ",".join(sorted(cache.name(t) for t in resident)),
            "waiting_lora_adapters": ",".join(sorted(cache.name(t) for t in waiting))}


@dataclass(frozen=True, slots=True)
class StepReport:
    """What the metrics learn from a step: its latency and kind (None: a change without a step), the engine's
    generated tokens so far, and, at most every GAUGE_PERIOD_S while steps run, every gauge and the LoRA info."""
    seconds: float | None
    kind: str
    num_generated_tokens: int
    time: float
    gauges: dict[tuple[str, tuple], float] | None = None
    lora: dict[str, str] | None = None


class StepReporter:
    """Makes each step's StepReport where the engine runs (gauges read the engine's state)."""

    def __init__(self):
        self.gauges_at = 0.0

    def report(self, engine, seconds: float | None, alive: bool) -> StepReport:
        now = time.time()
        due = seconds is None or not engine.has_unfinished or now - self.gauges_at >= GAUGE_PERIOD_S
        if due:
            self.gauges_at = now
        return StepReport(seconds, engine.last_step_kind, engine.num_generated_tokens, now,
                          gauges(engine, alive) if due else None, lora_info(engine) if due else None)


class ServerMetrics:
    """Metric objects from `new_family(name, help, kind)` (each with .Metric(labels=..., buckets=...)), updated under
    one lock (concurrent updates crash tritonserver 2.51). Each update is a round trip to the server, so a step's report
    (StepReport, made in the engine's process) brings its latency and generated tokens (the engine's count), and the
    gauges at most every GAUGE_PERIOD_S while steps run; only those that changed are sent."""

    def __init__(self, new_family: Callable[[str, str, str], object], labels: dict[str, str] | None = None):
        self.lock = threading.Lock()
        self.labels = labels or {}                          # on every metric: TensorRT-LLM's model and version
        self.new_family = new_family
        self.families = {f.name: new_family(f.name, f.help, f.kind) for f in FAMILIES}
        self.metrics: dict[tuple, object] = {}
        self.shown: dict[tuple, float] = {}                 # what each gauge was last set to
        self.num_tokens_shown = 0
        self.lora_labels: dict[str, str] | None = None
        self.lora_shown_at = 0.0
        for status in ("success", "failure", "cancelled"):
            self._metric("lora_llm_requests_total", (("status", status),))
        self._metric("lora_llm_generated_tokens_total", ())

    def _metric(self, family: str, labels: tuple, buckets: list[float] | None = None):
        key = (family, labels)
        if key not in self.metrics:
            kwargs = {"buckets": buckets} if buckets else {}
            self.metrics[key] = self.families[family].Metric(labels=dict(labels) | self.labels, **kwargs)
        return self.metrics[key]

    def count(self, status: str) -> None:
        with self.lock:
            if self.families:
                self._metric("lora_llm_requests_total", (("status", status),)).increment(1)

    def observe_ttft(self, seconds: float) -> None:
        with self.lock:
            if self.families:
                self._metric("lora_llm_time_to_first_token_seconds", (), LATENCY_BUCKETS).observe(seconds)

    def show(self, report: "StepReport") -> None:
        """A step's figures (or a change without a step), as the engine's process reported them."""
        with self.lock:
            if not self.families:
                return
            if report.seconds is not None:
                self._metric("lora_llm_step_seconds", (("kind", report.kind),), LATENCY_BUCKETS).observe(
                    report.seconds)
            if report.num_generated_tokens > self.num_tokens_shown:
                self._metric("lora_llm_generated_tokens_total", ()).increment(
                    report.num_generated_tokens - self.num_tokens_shown)
                self.num_tokens_shown = report.num_generated_tokens
            if report.gauges is None:
                return
            for key, value in report.gauges.items():
                if self.shown.get(key) != value:
                    self._metric(*key).set(value)
                    self.shown[key] = value
            if report.lora != self.lora_labels or report.time - self.lora_shown_at >= LORA_INFO_REFRESH_S:
                self._show_lora_info(report.lora, report.time)

    def show_broken(self) -> None:
        """The engine can serve no more (its process is gone)."""
        with self.lock:
            if self.families:
                self._metric("lora_llm_engine_alive", ()).set(0)
                self.shown[("lora_llm_engine_alive", ())] = 0

    def beat(self, unix_time: float) -> None:
        with self.lock:
            if self.families:
                self._metric(HEARTBEAT, ()).set(unix_time)

    def _show_lora_info(self, labels: dict[str, str], now: float) -> None:
        """One series, whose labels change with the adapters. Triton keeps a metric past its object; only its
        family's end takes it away, so a change of labels makes the family anew (three round trips)."""
        if labels != self.lora_labels and self.lora_labels is not None:
            self.metrics.pop((LORA_INFO, tuple(sorted(self.lora_labels.items()))), None)
            family = next(f for f in FAMILIES if f.name == LORA_INFO)
            self.families[LORA_INFO] = None                 # the old family goes before its successor comes
            self.families[LORA_INFO] = self.new_family(family.name, family.help, family.kind)
        self.lora_labels = labels
        self._metric(LORA_INFO, tuple(sorted(labels.items()))).set(now)
        self.lora_shown_at = now

    def close(self) -> None:
        """Frees every metric while the server still listens: freed at interpreter exit, they crash tritonserver."""
        import gc
        with self.lock:
            self.families, self.metrics = {}, {}
            gc.collect()
