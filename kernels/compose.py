"""Ops built from other ops, for backends that have no fused kernel of their own (kernels/dispatch.py, cpu_ops.py)."""
import torch


def compose_linear_lora(linear, lora_apply):
    """linear_lora where a backend has no fused one: its GEMM, then its LoRA added in place."""
    def linear_lora(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, proj, segments) -> torch.Tensor:
        out = linear(x, weight, bias)
        lora_apply(x, proj, segments, out)
        return out
    return linear_lora


def in_place(linear_lora):
    """linear_lora_deferred where a backend leaves no LoRA for the next op: linear_lora, and no delta."""
    def linear_lora_deferred(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, proj,
                             segments) -> tuple[torch.Tensor, None]:
        return linear_lora(x, weight, bias, proj, segments), None
    return linear_lora_deferred
