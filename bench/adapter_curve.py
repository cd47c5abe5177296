"""The adapter-count curve (S-LoRA's figure): a decode step of a batch of sequences over 1, 4, 16, ... distinct
adapters (ranks 8, 16, 32, 64 in turn, every module, all in the device tier at once), its time against the same
batch without adapters. Used by scripts/gpu_bench.py."""
import torch

from backend import LLMEngine
from backend.lora.limits import max_adapter_bytes
from backend.model.checkpoint import ModelConfig
from bench.adapters import register_copies
from bench.step_profile import decode_step_ms, free_memory
from bench.workloads import WORKLOADS, make_requests

RANKS = (8, 16, 32, 64)
COUNTS = (1, 4, 16, 64)


def adapter_curve(model_dir: str, device: str, num_seqs: int = 64, counts: tuple[int, ...] = COUNTS,
                  cuda_graph_mode: bool = True) -> dict:
    """{"base_step_ms", "num_seqs", "<n> adapters": {"step_ms", "vs_base"}}: an engine of max_loras max(counts)
    (bench.adapters.register_copies: distinct slots, distinct reads), num_seqs sequences decoding, sequence i on
    adapter i % n (adapter k at RANKS[k % 4]: one adapter is at rank 8, four or more mix the ranks evenly)."""
    cfg = ModelConfig.from_dir(model_dir)
    engine = LLMEngine(model_dir, dtype="bfloat16", device=device, cuda_graph_mode=cuda_graph_mode,
                       max_num_seqs=num_seqs, max_num_batched_tokens=2048, max_loras=max(counts),
                       max_lora_rank=max(RANKS), lora_cache_host_memory_bytes=max(counts) * max_adapter_bytes(
                           cfg, max(RANKS), torch.bfloat16))       # all of them, whatever the machine's memory says
    try:
        register_copies(engine, RANKS, max(counts))
        requests = make_requests(WORKLOADS["W2"], cfg.vocab_size, num_seqs)
        result = {"num_seqs": num_seqs, "base_step_ms": decode_step_ms(engine, requests)}
        for n in counts:
            for i, r in enumerate(requests):
                r["lora_task_id"] = 1 + i % n
            ms = decode_step_ms(engine, requests)
            result[f"{n} adapters"] = {"step_ms": ms, "vs_base": ms / result["base_step_ms"]}
        result["kernel_fallbacks"] = dict(engine.runner.kernel_fallbacks)
    finally:
        del engine
        free_memory(device)
    return result


def summary(result: dict) -> str:
    return (f"decode step of {result['num_seqs']} over n distinct adapters vs none ({result['base_step_ms']:.2f} "
            "ms): " + ", ".join(f"{key} {entry['vs_base']:.2f}x" for key, entry in result.items()
                                if key.endswith(" adapters")))
