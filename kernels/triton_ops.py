"""The Triton implementation of every op in kernels/dispatch.OP_NAMES (the GEMMs are still torch's)."""
import torch

from kernels.fused import add_rms_norm, rotary_and_cache, silu_and_mul
from kernels.lora import lora_expand, lora_shrink
from kernels.paged_attention import paged_attention
from kernels.reference import linear, prepare_weights

__all__ = ["prepare_weights", "linear", "add_rms_norm", "silu_and_mul", "rotary_and_cache", "paged_attention",
           "lora_apply"]


def lora_apply(x: torch.Tensor, proj, segments, out: torch.Tensor) -> None:
    """Semantics: kernels.reference.lora_apply (two launches for all the projection's bands: shrink, expand)."""
    lora_expand(lora_shrink(x, proj, segments), proj, segments, out)
