"""The adapter-count curve (S-LoRA's figure): a decode step of a batch of sequences over 1, 4, 16, ... distinct
adapters (ranks 8, 16, 32, 64 in turn, every module, all in the device tier at once), its time against the same
batch without adapters. Used by scripts/gpu_bench.py."""
import torch

from backend import LLMEngine
from backend.checkpoint import ModelConfig
from backend.lora.dora import checkpoint_weights
from backend.lora.limits import max_adapter_bytes
from backend.lora.peft import load_lora_dir
from bench.adapters import adapter_dirs
from bench.step_profile import decode_step_ms
from bench.workloads import WORKLOADS, make_requests

RANKS = (8, 16, 32, 64)
COUNTS = (1, 4, 16, 64)


def adapter_curve(model_dir: str, device: str, num_seqs: int = 64, counts: tuple[int, ...] = COUNTS,
                  cuda_graph_mode: bool = True) -> dict:
    """{"base_step_ms", "num_seqs", "<n> adapters": {"step_ms", "vs_base"}}: an engine of max_loras max(counts)
    (each adapter parsed once per rank and cached under as many task ids as need it: distinct slots, distinct
    reads), num_seqs sequences decoding, sequence i on adapter i % n (adapter k at RANKS[k % 4]: one adapter is at
    rank 8, four or more mix the ranks evenly)."""
    cfg = ModelConfig.from_dir(model_dir)
    engine = LLMEngine(model_dir, dtype="bfloat16", device=device, cuda_graph_mode=cuda_graph_mode,
                       max_num_seqs=num_seqs, max_num_batched_tokens=2048, max_loras=max(counts),
                       max_lora_rank=max(RANKS), lora_cache_host_memory_bytes=max(counts) * max_adapter_bytes(
                           cfg, max(RANKS), torch.bfloat16))       # all of them, whatever the machine's memory says
    try:
        base = checkpoint_weights(model_dir, engine.runner.dtype, engine.runner.device)
        parsed = [load_lora_dir(path, base, cfg) for path in adapter_dirs(model_dir, RANKS)]
        for task_id in range(1, max(counts) + 1):
            engine.add_lora(task_id, *parsed[(task_id - 1) % len(RANKS)])
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
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()
    return result


def summary(result: dict) -> str:
    return (f"decode step of {result['num_seqs']} over n distinct adapters vs none ({result['base_step_ms']:.2f} "
            "ms): " + ", ".join(f"{key} {entry['vs_base']:.2f}x" for key, entry in result.items()
                                if key.endswith(" adapters")))
