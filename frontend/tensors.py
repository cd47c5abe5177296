"""Adapters in the form the core takes them (TensorRT-LLM's fp16 tensors, the weights as the bytes a request
carries), kept ready under a byte budget, as a TensorRT-LLM client holds its adapters ready to send: read and
converted at start (up to the budget) or on first use, one at a time on a thread of their own, least recently
used dropped first."""
import asyncio
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True, slots=True)
class AdapterInputs:
    weights_shape: list[int]                  # lora_weights [1, N, R] as sent
    weights: bytes                            # its FP16 contents
    config: np.ndarray                        # lora_config [1, N, 3] int32

    @property
    def num_bytes(self) -> int:
        return len(self.weights) + self.config.nbytes


def read_tensors(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """(lora_weights [N, R] fp16, lora_config [N, 3] int32) of a PEFT or TensorRT-LLM adapter folder."""
    from backend.lora.peft import load_lora_dir, peft_to_trtllm
    if (path / "adapter_config.json").is_file():
        weights, config = peft_to_trtllm(path, "float16")          # no fp32 copy of the whole adapter
    else:
        weights, config = load_lora_dir(path)
    weights = weights.reshape(-1, weights.shape[-1])
    return weights.astype(np.float16, copy=False), config.reshape(-1, 3).astype(np.int32, copy=False)


class AdapterTensors:
    def __init__(self, budget_bytes: int = 1 << 30):
        self.budget_bytes = budget_bytes
        self.held: OrderedDict[Path, AdapterInputs] = OrderedDict()   # least recently used first
        self.num_bytes = 0
        self.lock = threading.Lock()
        self.converter = ThreadPoolExecutor(1, thread_name_prefix="adapter-tensors")  # beside the event loop, not
                                                                                       # against the engine's cores

    async def get(self, path: Path) -> AdapterInputs:
        with self.lock:
            if path in self.held:
                self.held.move_to_end(path)
                return self.held[path]
        return await asyncio.get_running_loop().run_in_executor(self.converter, self.load, path)

    def load(self, path: Path) -> AdapterInputs:
        """Read and keep (budget allowing, dropping the least recently used)."""
        weights, config = read_tensors(path)
        inputs = AdapterInputs([1, *weights.shape], weights.tobytes(), config[None])
        with self.lock:
            if inputs.num_bytes <= self.budget_bytes and path not in self.held:
                while self.num_bytes + inputs.num_bytes > self.budget_bytes:
                    self.num_bytes -= self.held.popitem(last=False)[1].num_bytes
                self.held[path] = inputs
                self.num_bytes += inputs.num_bytes
        return inputs

    def prepare(self, paths: list[Path]) -> None:
        """At start: read adapters in order while they fit the budget."""
        for path in paths:
            if self.num_bytes >= self.budget_bytes:
                return
            self.load(path)

    def drop(self, path: Path) -> None:
        with self.lock:
            if path in self.held:
                self.num_bytes -= self.held.pop(path).num_bytes
