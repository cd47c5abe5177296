"""The one place that picks the kernel implementation; the model calls `ops.<name>` and never branches."""
import os
from dataclasses import dataclass
from typing import Callable

import torch

from kernels.compose import compose_linear_lora, in_place
from kernels.lora_family import LoraFamily

OP_NAMES = ("prepare_weights", "linear", "add_rms_norm", "silu_and_mul", "rotary_and_cache", "paged_attention",
            "lora_apply", "linear_lora", "linear_lora_deferred", "fused_moe", "slot_lora")


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
    LoRA layout and per-step metadata, kernels/lora_family.py), `checked` (its op families are checked on the device
    at start and may fall back to the torch reference) and `graphs` (it takes CUDA graphs' padded steps)."""
    name: str
    lora: LoraFamily
    checked: bool
    graphs: bool
    prepare_weights: Callable
    linear: Callable
    add_rms_norm: Callable
    silu_and_mul: Callable
    rotary_and_cache: Callable
    paged_attention: Callable
    lora_apply: Callable
    linear_lora: Callable                     # a projection's GEMM with its LoRA (composed where the family has none)
    linear_lora_deferred: Callable            # the same, the LoRA product left for the next op where it can be
    fused_moe: Callable
    slot_lora: Callable

    def fall_back(self, names: set[str]) -> None:
        """Serve these ops with the torch reference from now on (the start-up self-check's verdict); the composed
        ops follow the ops they are made of."""
        from kernels import reference
        for name in names:
            setattr(self, name, getattr(reference, name))
        if names & {"linear", "lora_apply"}:              # (the overlapped and folded paths run the kernels' GEMM)
            self.linear_lora = compose_linear_lora(self.linear, self.lora_apply)
            self.linear_lora_deferred = in_place(self.linear_lora)


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
    ops = {op: getattr(module, op) for op in OP_NAMES if hasattr(module, op)}
    if backend == "triton":
        ops |= {op: broken(op) for op in broken_ops}
    ops.setdefault("linear_lora", compose_linear_lora(ops["linear"], ops["lora_apply"]))
    ops.setdefault("linear_lora_deferred", in_place(ops["linear_lora"]))
    return KernelBackend(name=backend, lora=LoraFamily.of(backend, device, lora_overlap, lora_fold),
                         checked=backend == "triton", graphs=backend == "triton", **ops)


def broken(op: str):
    def launch(*args, **kwargs):
        raise RuntimeError(f"{op}: too many resources requested for launch (inject_broken_ops)")
    return launch
