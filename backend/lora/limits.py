"""The adapter caches' sizes when left to `auto`: the largest adapter max_lora_rank allows on the served model, and a
host tier with room for twice max_loras of them (1 GiB at least), within a share of the machine's memory."""
import os
from dataclasses import replace
from pathlib import Path

import torch

from backend.config import LoraCacheConfig
from backend.lora.format import EXPERT_MODULE_NAMES, module_refusal, row_need
from backend.model.checkpoint import ModelConfig

HOST_SHARE = 0.25                             # of the machine's memory (or its cgroup's limit): an auto tier's most
HOST_FLOOR = 1 << 30                          # an auto tier's least, as the fixed default was


def max_adapter_bytes(model: ModelConfig, max_rank: int, dtype: torch.dtype) -> int:
    """A DoRA adapter at max_rank on every module (q, k, v, o, gate, up, down) of every layer that has it, and on a
    mixture's every expert, router and shared expert gate (modules 13-17, no DoRA there), stored in dtype: A, B and
    the magnitude of each."""
    modules = list(range(1, 8)) + (list(EXPERT_MODULE_NAMES) if model.num_experts else [])
    return sum(row_need(model, module, max_rank, module < 8) for layer in range(model.num_layers)
               for module in modules if module_refusal(model, module, layer) is None) * dtype.itemsize


def machine_memory_bytes() -> int:
    """Physical memory, or the cgroup's limit where one is set lower."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limit = Path("/sys/fs/cgroup/memory.max")
    if limit.is_file() and limit.read_text().strip().isdigit():
        total = min(total, int(limit.read_text()))
    return total


def resolve_limits(cfg: LoraCacheConfig, model: ModelConfig, dtype: torch.dtype) -> LoraCacheConfig:
    """cfg with `auto` sizes made numbers; a host tier that cannot hold one adapter of the largest size refuses to
    start, naming both settings and their sizes."""
    adapter = max_adapter_bytes(model, cfg.max_lora_rank, dtype) if cfg.max_adapter_bytes == "auto" \
        else cfg.max_adapter_bytes
    host = cfg.host_memory_bytes
    if host == "auto":
        cap = int(HOST_SHARE * machine_memory_bytes())
        host = min(max(HOST_FLOOR, 2 * cfg.max_loras * adapter), cap)
    if host < adapter:
        why = f" ({HOST_SHARE:.0%} of this machine's memory)" if cfg.host_memory_bytes == "auto" else ""
        raise ValueError(f"lora_cache_host_memory_bytes {host}{why} cannot hold one adapter of "
                         f"lora_cache_max_adapter_size {adapter} (max_lora_rank {cfg.max_lora_rank} on every module "
                         f"of this model in {str(dtype).removeprefix('torch.')}): raise the first or lower the second "
                         "(or max_lora_rank)")
    return replace(cfg, max_adapter_bytes=adapter, host_memory_bytes=host)
