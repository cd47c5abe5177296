"""The building blocks of a Llama-family layer: rotary tables and linear with LoRA (the fused elementwise ops are
kernels, see kernels/dispatch.py)."""
import math

import torch

from backend.checkpoint import ModelConfig


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2], with llama3-style scaling when the config asks for it."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = cfg.rope_scaling
    if scaling is None:
        return inv_freq
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling.get("original_max_position_embeddings", 8192)
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


def rope_cos_sin(cfg: ModelConfig) -> torch.Tensor:
    """[max_positions, head_dim] fp32: cos of each frequency in the first half, sin in the second."""
    positions = torch.arange(cfg.max_position_embeddings, dtype=torch.float32)
    freqs = positions[:, None] * rope_inv_freq(cfg)[None, :]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


def linear(ops, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, lora, layer: int,
           proj: str) -> torch.Tensor:
    """x @ weight^T (+ bias) by the kernel backend's GEMM, plus each token's adapter delta for this projection."""
    if lora is None:
        return ops.linear(x, weight, bias)
    return lora.linear(x, weight, bias, layer, proj)

