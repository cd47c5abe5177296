"""The one place that picks the kernel implementation; the model calls `ops.<name>` and never branches."""
import os
from types import SimpleNamespace

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


def load_ops(name: str, device: torch.device | str = "cpu", lora_overlap: bool = True, lora_fold: bool = True,
             broken_ops: tuple[str, ...] = ()) -> SimpleNamespace:
    """The kernel functions of one backend for tensors on `device`, by the names in OP_NAMES, and what the rest of
    the server asks of the family: `lora` (its LoRA layout and per-step metadata, kernels/lora_family.py, with
    the engine config's lora_overlap and lora_fold),
    `checked` (its op families are checked on the device at start and may fall back to the torch reference) and
    `graphs` (it takes CUDA graphs' padded steps)."""
    backend = resolve_backend(name, device)
    if backend == "torch":
        from kernels import reference as module
    elif backend == "cpu":
        from kernels import cpu_ops as module
    else:
        from kernels import triton_ops as module
    ops = SimpleNamespace(**{op: getattr(module, op) for op in OP_NAMES if hasattr(module, op)})
    if backend == "triton":
        for op in broken_ops:                                  # (the engine config's inject_broken_ops: a test hook)
            setattr(ops, op, broken(op))
    if not hasattr(ops, "linear_lora"):
        ops.linear_lora = compose_linear_lora(ops.linear, ops.lora_apply)
    if not hasattr(ops, "linear_lora_deferred"):
        ops.linear_lora_deferred = in_place(ops.linear_lora)
    ops.name = backend
    ops.lora = LoraFamily.of(backend, device, lora_overlap, lora_fold)
    ops.checked = ops.graphs = backend == "triton"
    return ops


def broken(op: str):
    def launch(*args, **kwargs):
        raise RuntimeError(f"{op}: too many resources requested for launch (inject_broken_ops)")
    return launch
