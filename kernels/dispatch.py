"""The one place that picks the kernel implementation; the model calls `ops.<name>` and never branches."""
import os
from dataclasses import dataclass, fields
from typing import Callable

import torch

from kernels.lora.executor import LoraExecutor
from kernels.lora.family import LoraFamily
from kernels.lora.segments import LoraSegments


def resolve_backend(name: str, device: torch.device | str = "cpu") -> str:
    """"auto" means Triton on CUDA, and on CPU the compiled CPU kernels ("cpu", kernels/cpu_ext.py) when they
    build here, else the torch reference ("torch"). "triton" on CPU runs the kernels in Triton's interpreter
    (TRITON_INTERPRET=1, for tests: far too slow to serve)."""
    on_cuda = torch.device(device).type == "cuda"
    if name == "auto":
        if on_cuda:
            return "triton"
        from kernels import cpu_ext
        return "cpu" if cpu_ext.available() else "torch"
    if name == "triton" and not (on_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        raise RuntimeError("kernel_backend 'triton' on CPU needs TRITON_INTERPRET=1 set before start (a test mode)")
    if name == "cpu" and on_cuda:
        raise RuntimeError("kernel_backend 'cpu' (the compiled CPU kernels) cannot run on CUDA")
    if name not in ("torch", "cpu", "triton"):
        raise ValueError(f"unknown kernel backend {name!r}")
    return name


@dataclass
class KernelBackend:
    """One kernel family's functions for tensors on one device (`name`: "torch", "cpu" or "triton"), each op of
    OP_NAMES with the torch reference's semantics, and what the rest of the server asks of the family: `lora` (its
    LoRA layout and per-step metadata, kernels/lora/family.py), `checked` (its op families are checked on the device
    at start and may fall back to the torch reference) and `graphs` (it takes CUDA graphs' padded steps)."""
    name: str
    lora: LoraFamily
    checked: bool
    graphs: bool
    prepare_weight: Callable
    linear: Callable
    add_rms_norm: Callable
    silu_and_mul: Callable
    rotary_and_cache: Callable
    paged_attention: Callable
    fused_moe: Callable
    slot_lora: Callable
    lora_executor: type                       # a step's LoRA, projections' GEMMs with it (kernels/lora/executor.py)

    def lora_for(self, segments: LoraSegments, slots) -> LoraExecutor:
        """The step's LoRA over its segments (on the device) and the device slots (backend/lora/slots.DeviceSlots)."""
        return self.lora_executor(self, segments, slots.projections, slots.experts)

    def fall_back(self, names: set[str]) -> None:
        """Serve these ops with the torch reference from now on (the start-up self-check's verdict)."""
        from kernels import reference
        for name in names:
            setattr(self, name, getattr(reference, name))


OP_NAMES = tuple(f.name for f in fields(KernelBackend) if f.name not in ("name", "lora", "checked", "graphs"))


def load_ops(name: str, device: torch.device | str = "cpu", lora_overlap: bool = True, lora_fold: bool = True,
             broken_ops: tuple[str, ...] = ()) -> KernelBackend:
    """The kernel backend `name` (resolve_backend) for tensors on `device`, its LoRA family with the engine config's
    lora_overlap and lora_fold. broken_ops (the engine config's inject_broken_ops, a test hook): Triton ops that
    raise at every call."""
    backend = resolve_backend(name, device)
    if backend == "torch":
        from kernels import reference as module
    elif backend == "cpu":
        from kernels import cpu_ops as module
    else:
        from kernels import triton_ops as module
    ops = {op: getattr(module, op) for op in OP_NAMES}
    if backend == "triton":
        ops |= {op: broken(op) for op in broken_ops}
    return KernelBackend(name=backend, lora=LoraFamily.of(backend, device, lora_overlap, lora_fold),
                         checked=backend == "triton", graphs=backend == "triton", **ops)


def broken(op: str):
    def launch(*args, **kwargs):
        raise RuntimeError(f"{op}: too many resources requested for launch (inject_broken_ops)")
    return launch
