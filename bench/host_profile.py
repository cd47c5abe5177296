"""Host milliseconds per decode step, by stage, with a model so small that its compute does not matter: what the
engine's own Python costs a step while a GPU would wait (scripts/bench.py --host-profile).

Stages: schedule (Scheduler.schedule), inputs (StepInputs: ids, positions, cache slots, block tables), sampling
inputs (sampler.prepare), upload (StepStaging's packing of the step's tensors into one buffer; on CPU measured into
an unpinned buffer, since the CPU path itself sends nothing), outputs (the rest of LLMEngine.step: the runner's glue
around the forward, the download, then per token the counters, the stop checks and its output: a token row, or a
StepOutput where the sequence ends; backend/core/outputs.py). The model's forward and the sampling math are device work,
and the OpenMP team's sizing (`cpu_team`, backend/openmp.py) happens on CPU only: each is timed, none is counted as
host time. The heap is frozen, as a server's engine loop freezes it.

On CUDA (`--host-device cuda`) the engine runs as it serves: CUDA graphs, steps one ahead; upload is the real one
(the ring's copy and the transfer's launch), `wait` the host waiting for a step's tokens (`Download.wait`: the
device's time, not counted), `step_ms` each step's wall time. A CPU forward leaves the host's caches cold for
what follows it (a numpy call right after costs 3-7x its warm time on a 2-core VM); a GPU's does not.
`--host-detail` splits `outputs` into the functions that make it (DETAIL_STAGES, each its own time).
`--host-churn` times decoding steps whose rows change instead: each round's sequences end one every other step
(the persistent batch removes a row, backend/model/batch.py), until the last.
`--host-forward cached` (CPU) replaces the forward, after its first call for each number of sampled rows, by a copy
of that call's logits: the engine's every other line runs as before, with the host's caches as warm as a GPU's host
keeps them (what is left is the host's own work; the CPU forward's eviction is the difference). `--host-evict-mb N`
adds that eviction back alone: the cached forward reads N MB of a buffer of its own (32 x 4k tokens of the tiny
model's KV are 32 MB, as much as this EPYC's L3).
"""
import statistics
import tempfile
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

import numpy as np
import torch

from backend import LLMEngine
from backend.core import sampler
from backend.core.scheduler import Scheduler
from backend.device import Download, StepStaging
from backend.heap import freeze_heap, unfreeze_heap
from backend.model.context import StepInputs
from backend.model.graphs import DecodeGraphs
from backend.model.batch import PersistentBatch
from backend.model.llama import LlamaModel
from backend.model.runner import ModelRunner
from backend.openmp import TeamSizer

TINY = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu", rms_norm_eps=1e-5,
            hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
            vocab_size=512, tie_word_embeddings=False, rope_theta=10000.0, max_position_embeddings=8192,
            bos_token_id=1, eos_token_id=2)
HOST_STAGES = ("schedule", "inputs", "sampling_inputs", "upload", "outputs")
DETAIL_STAGES = ("engine_launch", "runner_launch", "forward_glue", "graph_step", "replay", "download", "record",
                 "runner_collect", "engine_collect")          # --host-detail: parts of `outputs`, each its own time
CASES = ((1, 128), (32, 128), (128, 128), (32, 4096))        # (sequences, tokens of context)


def build_tiny_model(out: Path) -> Path:
    """A one-layer random Llama (hidden 64, 8k positions) saved as safetensors."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**TINY)).save_pretrained(out)
    return out


class StageClock:
    """Wraps the functions a step calls with timers; `seconds` sums each stage's own time over the steps timed (a
    stage called inside another, as the OpenMP team's checkpoint inside the forward, is taken out of the outer one).
    Each wrapped call adds ~2 us of its own to the step (nine a plain step: ~0.02 ms, with the timers and without)."""

    def __init__(self, detail: bool = False):
        self.detail = detail
        self.seconds: dict[str, float] = {}
        self.on = False
        self.patches: list[tuple[object, str, object]] = []
        self.inner: list[float] = []                    # per open stage: time of the stages called inside it

    def wrap(self, owner, name: str, stage: str, extra=None) -> None:
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            if not self.on:
                return original(*args, **kwargs)
            self.inner.append(0.0)
            start = time.perf_counter()
            try:
                result = original(*args, **kwargs)
                if extra is not None:
                    extra(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
                nested = self.inner.pop()
                self.seconds[stage] = self.seconds.get(stage, 0.0) + elapsed - nested
                if self.inner:
                    self.inner[-1] += elapsed
            return result
        self.patches.append((owner, name, original))
        setattr(owner, name, timed)

    @contextmanager
    def installed(self, engine: LLMEngine):
        cpu = engine.runner.device.type == "cpu"
        self.wrap(Scheduler, "schedule", "schedule")
        self.wrap(StepInputs, "__init__", "inputs")
        self.wrap(sampler, "prepare", "sampling_inputs")
        self.wrap(StepStaging, "upload", "upload", (lambda staging, t: staging.pack(t)) if cpu else None)
        self.wrap(LlamaModel, "forward", "model")
        self.wrap(TeamSizer, "start", "cpu_team")
        self.wrap(TeamSizer, "checkpoint", "cpu_team")
        self.wrap(sampler, "sample", "sampling")
        self.wrap(Download, "wait", "wait")
        if self.detail:
            for owner, name, stage in ((LLMEngine, "_launch", "engine_launch"), (ModelRunner, "_launch", "runner_launch"),
                                       (ModelRunner, "_forward", "forward_glue"), (DecodeGraphs, "run", "graph_step"),
                                       (torch.cuda.CUDAGraph, "replay", "replay"), (StepStaging, "download", "download"),
                                       (PersistentBatch, "record", "record"),
                                       (ModelRunner, "collect", "runner_collect"),
                                       (LLMEngine, "_collect", "engine_collect")):
                self.wrap(owner, name, stage)
        try:
            yield self
        finally:
            for owner, name, original in reversed(self.patches):
                setattr(owner, name, original)


@contextmanager
def cached_forward(evict_mb: int = 0):
    """LlamaModel.forward computed once for each number of sampled rows, then its logits copied (--host-forward
    cached): no KV is written or read after the first. evict_mb: each call then reads that many MB of a buffer of
    its own (--host-evict-mb), as a CPU forward streams its KV through the caches: the host's work after it finds
    them as cold as after the real one, and nothing else differs."""
    original, logits = LlamaModel.forward, {}
    streamed = np.ones(evict_mb << 18, dtype=np.float32)

    def forward(model, ctx, kv_caches, with_context=False):
        if with_context:                                  # (prompt logits asked for: never in the profile's steps)
            return original(model, ctx, kv_caches, with_context)
        num_rows = ctx.logits_indices.shape[0]
        if num_rows not in logits:
            logits[num_rows] = original(model, ctx, kv_caches)
        if evict_mb:
            streamed.sum()
        return logits[num_rows].clone()
    LlamaModel.forward = forward
    try:
        yield
    finally:
        LlamaModel.forward = original


def profile_case(engine: LLMEngine, num_seqs: int, context: int, num_steps: int, num_rounds: int,
                 detail: bool = False, churn: bool = False) -> dict:
    """num_seqs sequences with `context` prompt tokens each, prefilled, then num_rounds rounds of num_steps decode
    steps timed by stage: each stage's ms per step, the median over the rounds (`host_ms`: the sum of the host
    stages' medians, DETAIL_STAGES' too where timed). churn: each round's sequences are its own, one of them ending
    every other step (max_new_tokens 2, 4, 6, ...), and every step until the last ends is timed (num_steps unused):
    decoding steps whose rows change."""
    rounds = []
    for round_index in range(num_rounds if churn else 1):
        for i in range(num_seqs):
            prompt = [(7 * i + j) % 500 + 3 for j in range(context)]
            max_new_tokens = 2 * i + 2 if churn else num_rounds * num_steps + 4
            engine.add_request(prompt, max_new_tokens=max_new_tokens, ignore_end_id=True)
        while any(seq.num_computed_tokens < len(seq.prompt_ids)
                  for members in engine.seqs.values() for seq in members):
            engine.step()
        if churn:
            rounds.append(timed_steps(engine, None, detail))
            continue
        for _ in range(2):
            engine.step()                                              # warm
        rounds += [timed_steps(engine, num_steps, detail) for _ in range(num_rounds)]
        for request_id in list(engine.seqs):
            engine.abort(request_id)
    medians = {stage: statistics.median(r.get(stage, 0.0) for r in rounds) for stage in rounds[0]}
    medians["host_ms"] = sum(medians.get(s, 0.0) for s in HOST_STAGES + DETAIL_STAGES)
    return {"num_seqs": num_seqs, "context": context, **{k: round(v, 4) for k, v in medians.items()}}


def timed_steps(engine: LLMEngine, num_steps: int | None, detail: bool) -> dict:
    """num_steps steps (None: until nothing is unfinished) timed by stage -> each stage's ms per step."""
    clock, steps = StageClock(detail), 0
    start = time.perf_counter()
    with clock.installed(engine), torch.inference_mode():              # as a server's loop runs its steps
        clock.on = True
        while steps != num_steps and (num_steps is not None or engine.has_unfinished):
            engine.step()
            steps += 1
        clock.on = False
    total = time.perf_counter() - start
    per_step = {stage: seconds / steps * 1e3 for stage, seconds in clock.seconds.items()}
    per_step["outputs"] = (total - sum(clock.seconds.values())) / steps * 1e3   # every stage is in a step
    per_step["step_ms"] = total / steps * 1e3
    return per_step


def host_profile(num_steps: int = 40, num_rounds: int = 5, cases=CASES, kernel_backend: str = "auto",
                 device: str = "cpu", detail: bool = False, forward: str = "real", evict_mb: int = 0,
                 churn: bool = False) -> dict:
    """Every case on one engine over the tiny model (fp32); detail: `outputs` split into DETAIL_STAGES (each wrapped
    call adds ~2 us of its own); forward "cached": `cached_forward(evict_mb)`; churn: see profile_case."""
    if forward not in ("real", "cached"):
        raise ValueError(f"forward must be 'real' or 'cached', got {forward!r}")
    if evict_mb and forward != "cached":
        raise ValueError("evict_mb streams a buffer through a cached forward: it needs forward 'cached'")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp))
        engine = LLMEngine(str(model_dir), dtype="float32", device=device, kernel_backend=kernel_backend,
                           max_num_seqs=max(n for n, _ in cases), max_num_batched_tokens=8192,
                           kv_cache_memory_bytes=1 << 30, max_loras=1, max_lora_rank=8,
                           cuda_graph_mode=device != "cpu")
        freeze_heap()                                     # as a server's engine loop does
        try:
            with cached_forward(evict_mb) if forward == "cached" else nullcontext():
                return {"kernel_backend": engine.runner.ops.name, "device": str(engine.runner.device),
                        "num_steps": num_steps, "num_rounds": num_rounds, "forward": forward, "evict_mb": evict_mb,
                        "churn": churn,
                        "cases": [profile_case(engine, n, c, num_steps, num_rounds, detail, churn)
                                  for n, c in cases]}
        finally:
            unfreeze_heap()
            engine.close()


def print_profile(result: dict, machine: str) -> None:
    steps = ("the steps while a sequence ends every other step" if result.get("churn")
             else f"{result['num_steps']} steps")
    print(f"host ms per decode step by stage ({machine}; tiny model on {result['device']}, kernels "
          f"{result['kernel_backend']}, forward {result.get('forward', 'real')}"
          f"{', %d MB read in each' % result['evict_mb'] if result.get('evict_mb') else ''}, "
          f"medians of {result['num_rounds']} rounds of {steps}; model and sampling math excluded)")
    detail = tuple(s for s in DETAIL_STAGES if any(s in case for case in result["cases"]))
    head = ("seqs", "context") + HOST_STAGES + detail + ("host_ms", "model", "sampling", "cpu_team", "wait", "step_ms")
    print(" ".join(f"{h:>{max(7, len(h))}}" for h in head))
    for case in result["cases"]:
        print(" ".join(f"{case['num_seqs']:>7}" if h == "seqs" else f"{case['context']:>7}" if h == "context"
                       else f"{case.get(h, 0.0):>{max(7, len(h))}.3f}" for h in head))
