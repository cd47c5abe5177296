"""Adapters in the form the core takes them (TensorRT-LLM's fp16 tensors, the weights as the bytes a request
carries), checked as the core checks them and kept ready under a byte budget, as a TensorRT-LLM client holds its
adapters ready to send: read and converted at start (up to the budget) or on first use, one at a time on a thread of
their own, least recently used dropped first."""
import asyncio
import json
import os
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

class AdapterInvalid(Exception):
    """An adapter folder that cannot be served, and why (no paths in the message: it goes to clients)."""


@dataclass(frozen=True, slots=True)
class AdapterLimits:
    """What the served model accepts: its shape and the engine's max_lora_rank; its directory, whose weights a PEFT
    DoRA adapter's magnitudes are normalized against."""
    model: object                             # backend.model.checkpoint.ModelConfig
    max_lora_rank: int = 64
    model_dir: str | None = None
    weight_dtype: str = "auto"                # the engine's (backend/config.py)

    @property
    def max_file_bytes(self) -> int:
        """The largest an adapter's files may be: every module of every layer at max_lora_rank in fp32 (PEFT's
        safetensors, or TensorRT-LLM rows padded to the widest), and 1 MiB for headers and JSON."""
        from backend.lora.format import EXPERT_MODULE_NAMES, MODULE_NAMES, max_row_width
        modules = len(MODULE_NAMES) + (len(EXPERT_MODULE_NAMES) if self.model.num_experts else 0)
        return modules * self.model.num_layers * max_row_width(self.model, self.max_lora_rank) * 4 + (1 << 20)

    @property
    def max_adapter_bytes(self) -> int:
        """The largest valid adapter in fp16: max_lora_rank on every module of every layer."""
        import torch
        from backend.lora.limits import max_adapter_bytes
        return max_adapter_bytes(self.model, self.max_lora_rank, torch.float16)


@dataclass(frozen=True, slots=True)
class AdapterInputs:
    weights_shape: list[int]                  # lora_weights [1, N, R] as sent
    weights: bytes                            # its FP16 contents
    config: np.ndarray                        # lora_config [1, N, 3 or 4] int32
    digest: bytes = b""                       # of the files they were read from

    @property
    def num_bytes(self) -> int:
        return len(self.weights) + self.config.nbytes


def read_tensors(path: Path, limits: AdapterLimits | None = None) -> tuple[np.ndarray, np.ndarray, bytes]:
    """(lora_weights [N, R] fp16, lora_config [N, 3|4] int32, content digest) of a PEFT or TensorRT-LLM adapter folder
    (a PEFT DoRA one normalized against the served model's checkpoint, `limits.model_dir`), its files read safely
    (regular files, no links, sized before read: backend/lora/files.py); with `limits`, checked as the core checks an
    upload (PEFT shapes against the model's, rows, modules, layers, ranks, finite values)."""
    from backend.lora.dora import checkpoint_weights
    from backend.lora.files import AdapterFileError, read_adapter_files
    from backend.lora.peft import load_npy, peft_files_to_trtllm
    try:
        read = read_adapter_files(path, limits.max_file_bytes if limits is not None else None)
    except AdapterFileError as err:
        raise AdapterInvalid(str(err)) from None
    if "adapter_config.json" in read.files:
        guarded("adapter_config.json", lambda: json.loads(read.files["adapter_config.json"]))
        base = (checkpoint_weights(limits.model_dir, weight_dtype=limits.weight_dtype)
                if limits is not None and limits.model_dir else None)
        model = limits.model if limits is not None else None
        weights, config = guarded("adapter_model.safetensors",
                                  lambda: peft_files_to_trtllm(read.files, path, "float16", base, model), path)
    else:
        weights, config = (guarded(name, lambda: load_npy(read.files, name))
                           for name in ("model.lora_weights.npy", "model.lora_config.npy"))
    if weights.ndim < 2 or config.ndim < 2 or not np.issubdtype(config.dtype, np.integer):
        raise AdapterInvalid(f"lora_weights {list(weights.shape)} and lora_config {list(config.shape)} of "
                             f"{config.dtype} are not TensorRT-LLM's [N, R] and integer [N, 3]")
    weights = weights.reshape(-1, weights.shape[-1]).astype(np.float16, copy=False)
    config = config.reshape(-1, config.shape[-1])
    if limits is not None:
        check(weights, config, limits)
    return weights, config.astype(np.int32, copy=False), read.digest


def check(weights: np.ndarray, config: np.ndarray, limits: AdapterLimits) -> None:
    """The core's own checks of an upload (backend/lora/format.check_lora: shapes, rows, modules, layers, ranks,
    size), then finite values, in the fp16 the frontend sends; nothing converted: the core parses it, once."""
    import torch
    from backend.lora.format import check_lora
    from backend.core.request import RequestError
    try:
        check_lora(weights, config, limits.model, torch.float16, limits.max_lora_rank, limits.max_adapter_bytes)
    except RequestError as err:
        raise AdapterInvalid(f"{err.field}: {err.message}") from None
    if not np.isfinite(weights).all():
        raise AdapterInvalid("lora_weights: contains NaN or Inf values, or values beyond float16's range")


def guarded(file: str, read, path: Path | None = None):
    """read(), its failure (bad JSON, a foreign tensor, a truncated .npy, ...) an AdapterInvalid naming the file;
    no server path in the message (it goes to the client)."""
    try:
        return read()
    except Exception as err:
        message = str(err).splitlines()[0] if str(err) else type(err).__name__
        if path is not None:
            message = message.replace(str(path) + "/", "").replace(str(path), "the adapter folder")
        raise AdapterInvalid(f"{file}: {message[:300]}") from None


def stat_key(path: Path) -> tuple:
    """What changes when an adapter folder's files do: each one's inode, size and modification time."""
    from backend.lora.files import ADAPTER_FILES
    key = []
    for name in ADAPTER_FILES:
        try:
            info = os.lstat(path / name)
        except OSError:
            continue
        key.append((name, info.st_ino, info.st_size, info.st_mtime_ns))
    return tuple(key)


class AdapterTensors:
    """Adapters read, checked and held by folder while its files stay as they were read (inode, size, mtime); a
    folder whose files changed is read again, and its content digest tells the caller what it now holds."""

    def __init__(self, budget_bytes: int = 1 << 30, limits: AdapterLimits | None = None):
        self.budget_bytes = budget_bytes
        self.limits = limits
        self.held: OrderedDict[Path, tuple[tuple, AdapterInputs]] = OrderedDict()   # (stat key, inputs), least
                                                                                     # recently used first
        self.num_bytes = 0
        self.lock = threading.Lock()
        self.converter = ThreadPoolExecutor(1, thread_name_prefix="adapter-tensors")  # beside the event loop, not
                                                                                       # against the engine's cores

    async def get(self, path: Path) -> AdapterInputs:
        with self.lock:
            if path in self.held and self.held[path][0] == stat_key(path):
                self.held.move_to_end(path)
                return self.held[path][1]
        return await asyncio.get_running_loop().run_in_executor(self.converter, self.load, path)

    def load(self, path: Path) -> AdapterInputs:
        """Read, check and keep (budget allowing, dropping the least recently used)."""
        key = stat_key(path)
        weights, config, digest = read_tensors(path, self.limits)
        inputs = AdapterInputs([1, *weights.shape], weights.tobytes(), config[None], digest)
        with self.lock:
            self._drop(path)
            if inputs.num_bytes <= self.budget_bytes:
                while self.num_bytes + inputs.num_bytes > self.budget_bytes:
                    self.num_bytes -= self.held.popitem(last=False)[1][1].num_bytes
                self.held[path] = (key, inputs)
                self.num_bytes += inputs.num_bytes
        return inputs

    def prepare(self, paths: list[Path]) -> list[tuple[Path, str]]:
        """At start: read adapters in order while they fit the budget. -> (path, why) of each that cannot be
        served."""
        broken = []
        for path in paths:
            if self.num_bytes >= self.budget_bytes:
                break
            try:
                self.load(path)
            except AdapterInvalid as err:
                broken.append((path, str(err)))
        return broken

    def drop(self, path: Path) -> None:
        with self.lock:
            self._drop(path)

    def _drop(self, path: Path) -> None:
        if path in self.held:
            self.num_bytes -= self.held.pop(path)[1].num_bytes
