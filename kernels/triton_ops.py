"""The Triton implementation of every op in kernels/dispatch.OP_NAMES (GEMMs, the norm and the activation are still
torch's)."""
import torch

from kernels.kv_cache import write_kv_cache
from kernels.lora import lora_expand, lora_shrink
from kernels.paged_attention import paged_attention
from kernels.reference import add_rms_norm, linear, prepare_weights, silu_and_mul
from kernels.rotary import rotary

__all__ = ["prepare_weights", "linear", "add_rms_norm", "silu_and_mul", "rotary_and_cache", "paged_attention",
           "lora_apply"]


def rotary_and_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                     cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     slot_mapping: torch.Tensor) -> torch.Tensor:
    """Semantics: kernels.reference.rotary_and_cache (two launches: rotary, then the cache write)."""
    q, k = rotary(q, k, positions, cos_sin)
    write_kv_cache(k, v, k_cache, v_cache, slot_mapping)
    return q


def lora_apply(x: torch.Tensor, proj, segments, out: torch.Tensor) -> None:
    """Semantics: kernels.reference.lora_apply (two launches for all the projection's bands: shrink, expand)."""
    lora_expand(lora_shrink(x, proj, segments), proj, segments, out)
