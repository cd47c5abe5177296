"""The Triton implementation of every op in kernels/dispatch.OP_NAMES."""
from kernels.kv_cache import write_kv_cache
from kernels.lora import lora_expand, lora_shrink
from kernels.paged_attention import paged_attention
from kernels.rotary import rotary

__all__ = ["write_kv_cache", "rotary", "paged_attention", "lora_shrink", "lora_expand"]
