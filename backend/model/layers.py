"""Linear with LoRA, as a Llama-family layer calls it (the fused elementwise ops are kernels, see
kernels/dispatch.py; the rotary tables: rope.py)."""
import torch


def linear(ops, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, lora, layer: int,
           proj: str) -> torch.Tensor:
    """x @ weight^T (+ bias) by the kernel backend's GEMM, plus each token's adapter delta for this projection."""
    if lora is None:
        return ops.linear(x, weight, bias)
    return lora.linear(x, weight, bias, layer, proj)



def linear_deferred(ops, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, lora, layer: int,
                    proj: str) -> tuple[torch.Tensor, object | None]:
    """linear, but where the step folds LoRA (graph steps, LoRA beside the GEMMs) the adapter delta is left for the
    op that reads the output next (add_rms_norm, silu_and_mul, rotary_and_cache: their `delta`): (out, LoraDelta),
    else (out, None)."""
    if lora is None:
        return ops.linear(x, weight, bias), None
    return lora.linear_deferred(x, weight, bias, layer, proj)
