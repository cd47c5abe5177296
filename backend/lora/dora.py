"""DoRA magnitudes as the runtime takes them: a PEFT adapter's magnitude m becomes m / ||W + s·B·A|| per output row
(TensorRT-LLM's normalize_weights.py does the same before its converter), so that serving needs no base weights.

The norms are taken against the served model's own base weights, read from its checkpoint one module at a time in
the serving dtype, on the device asked for: whole rows, so tensor parallelism needs no cross-rank sum (rank 0 has
every row this way). A zero norm is refused rather than divided by."""
from collections.abc import Callable
from pathlib import Path

import torch

from backend.model.checkpoint import CheckpointReader
from kernels.quant import quantize_weight

PEFT_PROJ = {0: ("self_attn.qkv_proj",), 1: ("self_attn.q_proj",), 2: ("self_attn.k_proj",),
             3: ("self_attn.v_proj",), 4: ("self_attn.o_proj",),
             5: ("mlp.gate_proj", "mlp.gate_up_proj", "mlp.shared_expert.gate_proj"),
             6: ("mlp.down_proj", "mlp.shared_expert.down_proj"), 7: ("mlp.up_proj", "mlp.shared_expert.up_proj")}
                                              # the first the checkpoint has (Phi-3 fuses; Qwen2-MoE's shared expert)
BaseWeight = Callable[[int, int], torch.Tensor]            # (layer, module_id) -> W [out_dim, in_dim]


def checkpoint_weights(model_dir: str | Path, dtype: torch.dtype | None = None, device="cpu",
                       weight_dtype: str = "auto") -> BaseWeight:
    """A base model's module weights as they are served: read from its safetensors (one at a time, its file closed
    after; an FP8 checkpoint's dequantized), in dtype; with weight_dtype int8 or int4, quantized and dequantized as
    the served weight is (each output row on its own scales, so a module alone rounds as it does inside a fused
    projection)."""
    reader = CheckpointReader(model_dir)

    def weight(layer: int, module_id: int) -> torch.Tensor:
        keys = [f"model.layers.{layer}.{name}.weight" for name in PEFT_PROJ[module_id]]
        key = next((key for key in keys if key in reader), keys[0])
        try:
            w = reader.get_slice(key)[:].to(device)
        finally:
            reader.close()
        w = w if dtype is None else w.to(dtype)
        return w if weight_dtype == "auto" else quantize_weight(w, weight_dtype).dequantize(w.dtype)
    return weight


def normalized_magnitude(magnitude: torch.Tensor, a: torch.Tensor, b_scaled: torch.Tensor, weight: torch.Tensor,
                         what: str) -> torch.Tensor:
    """m / ||W + B·A||_row in fp32 (b_scaled: B with the LoRA scale folded in); `what` names the module in errors."""
    if magnitude.shape != (weight.shape[0],):
        raise ValueError(f"{what}: a DoRA magnitude of shape {list(magnitude.shape)}, the module has "
                         f"{weight.shape[0]} output features")
    device = weight.device
    norm = torch.linalg.norm(weight.float() + b_scaled.float().to(device) @ a.float().to(device), dim=1)
    if not bool((norm > 0).all()):
        raise ValueError(f"{what}: ||W + s·B·A|| is zero for an output row: its DoRA magnitude cannot be normalized")
    return (magnitude.float().to(device) / norm).cpu()
