"""Two-tier adapter cache with the semantics of TensorRT-LLM's PEFT cache.

Host tier: parsed adapters under a byte budget, LRU among those no waiting or running request uses.
Device tier: a fixed number of slots; an adapter is copied in when a request using it is scheduled, pinned
while any running request uses it, evicted LRU otherwise. The scheduler asks `can_acquire` before admitting.
"""
from collections import Counter, OrderedDict
from dataclasses import dataclass

import torch

from backend.config import LoraCacheConfig
from backend.core.request import RequestError
from backend.lora.format import LoraAdapter, check_lora, parse_lora
from backend.lora.limits import resolve_limits
from backend.lora.shard import shard_adapter
from backend.lora.slots import DeviceSlots
from backend.model.checkpoint import ModelConfig
from kernels.lora.family import LoraFamily


def not_found_message(task_id: int) -> str:
    return f"LoRA task {task_id} not found in cache. Please send LoRA weights with request"


@dataclass(slots=True)
class LoraCacheStats:
    host_hits: int = 0
    host_misses: int = 0
    host_evictions: int = 0
    device_hits: int = 0
    device_misses: int = 0
    device_evictions: int = 0
    host_bytes: int = 0
    device_bytes: int = 0
    device_pins: int = 0                      # running requests holding a slot


class LoraCache:
    def __init__(self, cfg: LoraCacheConfig, model_cfg: ModelConfig, dtype: torch.dtype, device="cpu",
                 family: LoraFamily | None = None, tp=None):
        """family: how the kernels read the device slots (default: the torch reference's). tp: the tensor-parallel
        group (backend/model/parallel.py), whose ranks each hold their share of every
        adapter in a device slot (backend/lora/shard.py); the host tier keeps the whole adapters, on rank 0."""
        self.cfg = resolve_limits(cfg, model_cfg, dtype)     # auto sizes from the model and the adapters' dtype
        self.model_cfg = model_cfg
        self.dtype = dtype
        self.device = torch.device(device)
        self.host: OrderedDict[int, LoraAdapter] = OrderedDict()      # least recently used first
        self.versions: dict[int, int] = {}                            # adapters inserted under each task id
        self.in_use: Counter[int] = Counter()                          # waiting + running requests per task
        self.tp = tp
        tp_size = tp.size if tp is not None else 1
        self.slots = DeviceSlots(model_cfg.shard(tp_size), cfg.max_loras, cfg.max_lora_rank, dtype, self.device,
                                 family)
        self.slot_of: dict[int, int] = {}
        self.pins = [0] * cfg.max_loras
        self.idle_slots: OrderedDict[int, None] = OrderedDict(     # unpinned, LRU first
            (s, None) for s in range(cfg.max_loras))
        self.stats = LoraCacheStats()
        self.names: dict[int, str] = {}                               # what requests called each cached adapter

    # host tier ------------------------------------------------------------------------------------------
    def parse(self, weights, config) -> LoraAdapter:
        """Validate and convert TRT-LLM tensors, pinned where the device is a GPU. Touches no cache state: servers
        call it off the engine thread."""
        return parse_lora(weights, config, self.model_cfg, self.dtype, self.cfg.max_lora_rank,
                          self.cfg.max_adapter_bytes).pinned(self.device)

    def add(self, task_id: int, weights, config) -> None:
        self.insert(task_id, self.parse(weights, config))

    def insert(self, task_id: int, adapter: LoraAdapter) -> None:
        """Keep a parsed adapter. Sending the same adapter again is a no-op; a different one under a known id is
        refused."""
        if task_id in self.host:
            if not self.host[task_id].same_as(adapter):
                raise RequestError("lora_task_id", f"LoRA task {task_id} is already cached with different weights")
            self.host.move_to_end(task_id)
            return
        size = adapter.num_bytes
        if size > self.cfg.host_memory_bytes:
            raise RequestError("lora_weights", f"adapter of {size} bytes exceeds lora_cache_host_memory_bytes "
                                               f"{self.cfg.host_memory_bytes}")
        while self.stats.host_bytes + size > self.cfg.host_memory_bytes:
            victim = next((t for t in self.host if self.in_use[t] == 0), None)
            if victim is None:
                raise RequestError("lora_weights", f"lora_cache_host_memory_bytes {self.cfg.host_memory_bytes} "
                                                   "is full of adapters in use; retry later")
            self._evict_host(victim)
        self.host[task_id] = adapter.pinned(self.device)
        self.stats.host_bytes += size
        self.versions[task_id] = self.versions.get(task_id, 0) + 1

    def key(self, task_id: int | None) -> bytes:
        """The identity of the adapter a task id names now (its weights may change after an eviction)."""
        return b"" if task_id is None else f"{task_id}.{self.versions[task_id]}".encode()

    def name(self, task_id: int) -> str:
        return self.names.get(task_id, str(task_id))

    def contains(self, task_id: int) -> bool:
        return task_id in self.host

    def holds(self, task_id: int, weights, config) -> bool:
        """The host tier has this task id with the adapter these lora_weights and lora_config give (checked first)."""
        adapter = self.host.get(task_id)
        if adapter is None:
            return False
        weights, _, rows = check_lora(weights, config, self.model_cfg, self.dtype, self.cfg.max_lora_rank,
                                      self.cfg.max_adapter_bytes)
        return adapter.matches(weights, rows, self.model_cfg)

    def ref(self, task_id: int | None) -> None:
        """A request that uses the adapter entered the engine: keep the adapter on the host."""
        if task_id is None:
            return
        if task_id not in self.host:
            self.stats.host_misses += 1
            raise RequestError("lora_task_id", not_found_message(task_id))
        self.stats.host_hits += 1
        self.in_use[task_id] += 1
        self.host.move_to_end(task_id)

    def unref(self, task_id: int | None) -> None:
        if task_id is not None:
            self.in_use[task_id] -= 1
            if self.in_use[task_id] == 0:
                del self.in_use[task_id]

    def remove(self, task_id: int) -> None:
        """Drop an adapter no request uses from both tiers (the start-up check's probes)."""
        slot = self.slot_of.get(task_id)
        assert not self.in_use[task_id] and (slot is None or not self.pins[slot]), "an adapter in use"
        self._evict_host(task_id)

    def _evict_host(self, task_id: int) -> None:
        slot = self.slot_of.pop(task_id, None)
        if slot is not None:                              # the device tier only holds what the host has
            self.stats.device_bytes -= self.host[task_id].num_bytes
            self.stats.device_evictions += 1
        adapter = self.host.pop(task_id)
        self.names.pop(task_id, None)
        self.stats.host_bytes -= adapter.num_bytes
        self.stats.host_evictions += 1

    # device tier (the scheduler's AdapterSlots) ----------------------------------------------------------
    def slot(self, task_id: int | None) -> int:
        return -1 if task_id is None else self.slot_of[task_id]

    def can_acquire(self, task_id: int | None) -> bool:
        return task_id is None or task_id in self.slot_of or bool(self.idle_slots)

    def acquire(self, task_id: int | None) -> None:
        if task_id is None:
            return
        slot = self.slot_of.get(task_id)
        if slot is not None:
            self.stats.device_hits += 1
        else:
            slot = self._free_slot()
            self._load(task_id, slot)
        self.pins[slot] += 1
        self.stats.device_pins += 1
        self.idle_slots.pop(slot, None)

    def prefetch(self, task_ids: list[int | None]) -> None:
        """Start uploading the adapters of the next waiting requests (in queue order) into idle slots, so that on
        CUDA the copies overlap the step running now. Never evicts an adapter these requests use."""
        wanted = list(dict.fromkeys(t for t in task_ids if t is not None and t in self.host))
        for task_id in wanted:
            if task_id in self.slot_of:
                continue
            slot = self._free_slot(keep=set(wanted))
            if slot is None:
                return
            self._load(task_id, slot)
            self.idle_slots.move_to_end(slot)

    def wait_for_slots(self, slots: list[int]) -> None:
        """Make the step's device work wait until the uploads into these slots are done (CUDA)."""
        self.slots.copies.wait({slot for slot in slots if slot >= 0})

    def _free_slot(self, keep: set[int] = frozenset()) -> int | None:
        """An idle slot for a new adapter: an empty one first, else the least recently used one whose adapter
        is not in `keep`."""
        owner_of = {slot: task for task, slot in self.slot_of.items()}
        empty = [slot for slot in self.idle_slots if slot not in owner_of]
        if empty:
            return empty[0]
        return next((slot for slot in self.idle_slots if owner_of[slot] not in keep), None)

    def _load(self, task_id: int, slot: int) -> None:
        self.stats.device_misses += 1
        owner = next((t for t, s in self.slot_of.items() if s == slot), None)
        if owner is not None:
            del self.slot_of[owner]
            self.stats.device_evictions += 1
            self.stats.device_bytes -= self.host[owner].num_bytes
        adapter = self.host[task_id]
        if self.tp is None:
            self.slots.load(slot, adapter)
        else:
            shares = [shard_adapter(adapter, self.model_cfg, self.tp.size, rank) for rank in range(self.tp.size)]
            self.tp.load_adapter(slot, shares)
            self.slots.load(slot, shares[0])
        self.slot_of[task_id] = slot
        self.stats.device_bytes += self.host[task_id].num_bytes

    def release(self, task_id: int | None) -> None:
        if task_id is None:
            return
        slot = self.slot_of[task_id]
        self.pins[slot] -= 1
        self.stats.device_pins -= 1
        if self.pins[slot] == 0:
            self.idle_slots[slot] = None                  # most recently used last
