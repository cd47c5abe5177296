"""The Triton implementation of every op in kernels/dispatch.OP_NAMES (the GEMMs over full-precision weights are
still torch's)."""
from kernels.fused import add_rms_norm, rotary_and_cache, silu_and_mul
from kernels.gemm import linear, prepare_weight
from kernels.lora.executor import TritonLoraExecutor as lora_executor
from kernels.moe import fused_moe, slot_lora
from kernels.paged_attention import paged_attention

__all__ = ["prepare_weight", "linear", "add_rms_norm", "silu_and_mul", "rotary_and_cache", "paged_attention",
           "fused_moe", "slot_lora", "lora_executor"]
