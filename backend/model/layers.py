"""The building blocks of a Llama-family layer: norms, rotary tables, linear with LoRA, the MLP activation."""
import math

import torch
import torch.nn.functional as F

from backend.model.config import ModelConfig


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm with the variance in fp32, as Llama computes it."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


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


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, lora, layer: int, proj: str) -> torch.Tensor:
    """x @ weight^T (+ bias), plus each token's adapter delta for this projection."""
    out = F.linear(x, weight, bias)
    if lora is not None:
        lora.apply(x, out, layer, proj)
    return out


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
