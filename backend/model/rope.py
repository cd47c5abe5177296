"""Rotary position embeddings: the frequencies of each RoPE type a checkpoint may name, and the cos/sin table the
rotary kernels read by row.

Types (`rope_scaling` / `rope_parameters` in config.json), each as transformers computes it:
    default   theta ** (-2i / d)
    linear    default / factor
    llama3    low frequencies / factor, high ones as they are, a smooth ramp between
    yarn      interpolated (/ factor) and extrapolated frequencies blended by a ramp over the dimensions, cos and sin
              scaled by its attention factor (0.1 ln(factor) + 1 unless given)
    longrope  default / short_factor up to original_max_position_embeddings, / long_factor past it, cos and sin
              scaled by sqrt(1 + ln(factor) / ln(original)) unless given
    dynamic   NTK scaling, which transformers applies only past max_position_embeddings: within it (all a request
              may reach here) the default frequencies

Which longrope factors a token gets is transformers' rule for one sequence: those of the longest position of the
forward that computes it, the whole prompt for a prompt token, the token itself for a generated one. So a token at
position p of a sequence whose prompt holds L tokens uses the long factors where max(L, p + 1) > original. Rows
[0, max_positions) of the table hold what generated tokens need at their position (short below the original
context, long from it on); rows max_positions + p hold long factors for the prompt tokens below the original context
of a prompt longer than it (`rows`). Every other type has one row per position. (transformers' Phi3ForCausalLM
also computes a sequence again, long, when it first grows past the original context; here its cache stays.)
"""
import math

import numpy as np
import torch

from backend.model.checkpoint import ModelConfig


def inv_freq(cfg: ModelConfig, long: bool = False) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [rotary_dim // 2], the factor cos and sin are scaled by); long: longrope's long factors."""
    dim, base, scaling = cfg.rotary_dim or cfg.head_dim, cfg.rope_theta, cfg.rope_scaling or {}
    kind = scaling.get("rope_type", "default")
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    default = 1.0 / (base ** exponents)
    if kind in ("default", "dynamic"):
        return default, 1.0
    if kind == "linear":
        return default / scaling["factor"], 1.0
    if kind == "llama3":
        return llama3(default, scaling), 1.0
    if kind == "yarn":
        return yarn(cfg, exponents, scaling)
    if kind == "longrope":
        original = scaling["original_max_position_embeddings"]
        factors = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32)
        factor = scaling.get("factor") or cfg.max_position_embeddings / original
        attention = scaling.get("attention_factor") or (
            math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0)
        return 1.0 / (factors * base ** exponents), attention
    raise ValueError(f"unsupported rope_type {kind!r}")


def llama3(inv: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling.get("original_max_position_embeddings", 8192)
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


def yarn(cfg: ModelConfig, exponents: torch.Tensor, scaling: dict) -> tuple[torch.Tensor, float]:
    """YaRN: dimensions that turn fewer than beta_slow times over the original context interpolated, more than
    beta_fast times extrapolated, a linear ramp between."""
    dim, base = cfg.head_dim, cfg.rope_theta
    original = scaling.get("original_max_position_embeddings") or cfg.max_position_embeddings
    factor = scaling.get("factor") or cfg.max_position_embeddings / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
    attention = scaling.get("attention_factor")
    if attention is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))
    low, high = correction_dim(scaling.get("beta_fast") or 32), correction_dim(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / ((high - low) or 0.001)).clamp(0, 1)
    extrapolated = 1 - ramp
    pos_freqs = base ** exponents
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolated) + (1.0 / pos_freqs) * extrapolated, float(attention)


def table(positions: torch.Tensor, inv: torch.Tensor, attention: float, head_dim: int) -> torch.Tensor:
    """[len(positions), head_dim] fp32: cos of each frequency in the first half, sin in the second, scaled; past
    the frequencies (a partial rotary, ModelConfig.rotary_order) cos 1 and sin 0, unscaled: channels left as they
    are."""
    freqs = positions.float()[:, None] * inv[None, :]
    passing = head_dim // 2 - inv.numel()
    cos, sin = freqs.cos() * attention, freqs.sin() * attention
    if passing:
        cos = torch.cat((cos, torch.ones(len(positions), passing)), dim=-1)
        sin = torch.cat((sin, torch.zeros(len(positions), passing)), dim=-1)
    return torch.cat((cos, sin), dim=-1)


def cos_sin(cfg: ModelConfig) -> torch.Tensor:
    """The rows the rotary kernels read: one per position, and for longrope the long rows of prompt tokens below
    the original context after them (see the module docstring)."""
    positions = torch.arange(cfg.max_position_embeddings)
    original = long_rope_original(cfg)
    short = table(positions, *inv_freq(cfg), cfg.head_dim)
    if original is None:
        return short
    long = table(positions, *inv_freq(cfg, long=True), cfg.head_dim)
    return torch.cat([short[:original], long[original:], long[:original]])


def long_rope_original(cfg: ModelConfig) -> int | None:
    """longrope's original context (below it, short factors), or None for any other type."""
    scaling = cfg.rope_scaling or {}
    return scaling["original_max_position_embeddings"] if scaling.get("rope_type") == "longrope" else None


def rows(cfg: ModelConfig, positions: np.ndarray, prompt_lens: np.ndarray) -> np.ndarray:
    """Each token's row of `cos_sin`: its position, but for the long rows of a long prompt's tokens below the
    original context (longrope)."""
    original = long_rope_original(cfg)
    if original is None:
        return positions
    return positions + cfg.max_position_embeddings * ((prompt_lens > original) & (positions < original))
