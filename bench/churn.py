"""Adapter churn on a device (W5 of shared/BENCHMARKS.md, issue 66): how long one adapter takes from the host tier
into a device slot, whether those uploads slow the decode steps running beside them, and W5's 128 adapters through
device tiers of a few sizes against W1. Used by bench/gpu_churn.py."""
import itertools
import time
from dataclasses import asdict

import torch

from backend import LLMEngine
from backend.lora.format import LoraAdapter, module_shape
from backend.lora.limits import max_adapter_bytes
from backend.lora.slots import DeviceSlots
from backend.model.checkpoint import ModelConfig
from bench.adapters import register_copies
from bench.engine import make_engine, run_engine
from bench.step_profile import abort_all, free_memory, start_decoding, sync
from bench.workloads import WORKLOADS, make_requests

DISTINCT_FILES = 16                           # W5's adapters: this many files, each under 128 / 16 task ids


def full_adapter(cfg: ModelConfig, rank: int, dtype: torch.dtype) -> LoraAdapter:
    """Every module (q, k, v, o, gate, up, down) of every layer at `rank`, random."""
    g = torch.Generator().manual_seed(rank)
    weights = {}
    for layer in range(cfg.num_layers):
        for module_id in range(1, 8):
            in_dim, out_dim = module_shape(cfg, module_id)
            weights[(layer, module_id)] = (torch.randn(rank, in_dim, generator=g).to(dtype),
                                           torch.randn(out_dim, rank, generator=g).to(dtype))
    return LoraAdapter(weights)


def upload_ms(cfg: ModelConfig, device: str, ranks: tuple[int, ...] = (16, 64), repeats: int = 3) -> dict:
    """{rank: {"ms", "bytes", "gb_s"}}: one adapter on every module, from pinned host memory into a device slot
    (DeviceSlots.load on its copy stream, waited for), the median of `repeats`."""
    device = torch.device(device)
    slots = DeviceSlots(cfg, 1, max(ranks), torch.bfloat16, device)
    result = {}
    for rank in ranks:
        adapter = full_adapter(cfg, rank, torch.bfloat16).pinned(device)
        times = []
        for _ in range(repeats):
            sync(device)
            start = time.perf_counter()
            slots.load(0, adapter)
            slots.copies.wait([0])
            sync(device)
            times.append(time.perf_counter() - start)
        ms = sorted(times)[len(times) // 2] * 1e3
        result[rank] = {"ms": ms, "bytes": adapter.num_bytes, "gb_s": adapter.num_bytes / ms / 1e6}
    del slots
    return result


def w5_engine(model_dir: str, device: str, device_tier: int, cuda_graph_mode: bool) -> LLMEngine:
    workload = WORKLOADS["W5"]
    engine = LLMEngine(model_dir, dtype="bfloat16", device=device, cuda_graph_mode=cuda_graph_mode,
                       max_num_seqs=workload.max_num_seqs, max_num_batched_tokens=2048, max_loras=device_tier,
                       max_lora_rank=workload.max_lora_rank,
                       lora_cache_host_memory_bytes=2 * len(workload.adapter_ranks) * max_adapter_bytes(
                           ModelConfig.from_dir(model_dir), workload.max_lora_rank, torch.bfloat16))
    register_copies(engine, workload.adapter_ranks[:DISTINCT_FILES], len(workload.adapter_ranks))
    return engine


def w5(model_dir: str, device: str, device_tier: int, num_requests: int | None = None,
       cuda_graph_mode: bool = True) -> dict:
    """W5 through a device tier of `device_tier` slots: tokens/s, latencies and the device tier's loads."""
    engine = w5_engine(model_dir, device, device_tier, cuda_graph_mode)
    try:
        requests = make_requests(WORKLOADS["W5"], engine.model_config.vocab_size, num_requests)
        run_engine(engine, requests[:2], f"W5 tier {device_tier} warm-up")
        before = asdict(engine.lora_cache.stats)
        run = run_engine(engine, requests, f"W5 tier {device_tier}")
        after = asdict(engine.lora_cache.stats)
        run = {k: v for k, v in run.items() if not isinstance(v, list)}
        run["device_loads"] = after["device_misses"] - before["device_misses"]
        run["device_evictions"] = after["device_evictions"] - before["device_evictions"]
        if device_tier > 16:
            run["uploads_beside_decoding"] = uploads_beside_decoding(engine)
    finally:
        del engine
        free_memory(device)
    return run


def uploads_beside_decoding(engine: LLMEngine, num_seqs: int = 8, num_steps: int = 20) -> dict:
    """Decode steps of num_seqs sequences on resident adapters, timed alone and with one other adapter uploaded
    into an idle slot before each step (the cache's prefetch, as for the next waiting request): the step time
    each way; ~1x means the uploads overlap decoding."""
    cfg = engine.model_config
    requests = make_requests(WORKLOADS["W5"], cfg.vocab_size, num_seqs)
    for i, r in enumerate(requests):
        r["lora_task_id"] = 1 + i
    start_decoding(engine, requests, 3 * num_steps + 8)
    device = engine.runner.device
    cache = engine.lora_cache
    others = itertools.cycle([task for task in cache.host if task not in cache.slot_of])    # each one an upload

    def steps_ms(upload: bool) -> float:
        sync(device)
        start = time.perf_counter()
        for _ in range(num_steps):
            if upload:
                engine.lora_cache.prefetch([next(others)])
            engine.step()
        sync(device)
        return (time.perf_counter() - start) / num_steps * 1e3
    steps_ms(False)
    alone = steps_ms(False)
    loads = engine.lora_cache.stats.device_misses
    beside = steps_ms(True)
    loads = engine.lora_cache.stats.device_misses - loads
    abort_all(engine)
    return {"step_ms_alone": alone, "step_ms_with_uploads": beside, "ratio": beside / alone, "uploads": loads}


def w1(model_dir: str, device: str, num_requests: int | None = None, cuda_graph_mode: bool = True) -> dict:
    """W1 on the engine W1 asks for, the reference W5 is held against."""
    engine = make_engine(model_dir, "bfloat16", WORKLOADS["W1"], device, cuda_graph_mode=cuda_graph_mode)
    try:
        requests = make_requests(WORKLOADS["W1"], engine.model_config.vocab_size, num_requests)
        run_engine(engine, requests[:2], "W1 warm-up")
        run = run_engine(engine, requests, "W1")
    finally:
        del engine
        free_memory(device)
    return {k: v for k, v in run.items() if not isinstance(v, list)}
