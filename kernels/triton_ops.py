"""The Triton implementation of every op in kernels/dispatch.OP_NAMES (the GEMMs over full-precision weights are
still torch's)."""
from kernels.fused import add_rms_norm, rotary_and_cache, silu_and_mul
from kernels.gemm import linear
from kernels.lora import lora_apply
from kernels.lora_overlap import linear_lora, linear_lora_deferred
from kernels.moe import fused_moe, slot_lora
from kernels.paged_attention import paged_attention
from kernels.reference import prepare_weights

__all__ = ["prepare_weights", "linear", "add_rms_norm", "silu_and_mul", "rotary_and_cache", "paged_attention",
           "lora_apply", "linear_lora", "linear_lora_deferred", "fused_moe", "slot_lora"]

