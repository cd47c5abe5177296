"""Write the step's new K and V into the paged cache through the slot mapping."""
import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh, stride_ch, stride_cs,
                     HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    token = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:                                  # padding token: nothing to write
        return
    d = tl.arange(0, BLOCK_D)
    mask = d < HEAD_DIM
    k = tl.load(k_ptr + token.to(tl.int64) * stride_kt + head * stride_kh + d, mask=mask)
    v = tl.load(v_ptr + token.to(tl.int64) * stride_vt + head * stride_vh + d, mask=mask)
    dst = head.to(tl.int64) * stride_ch + slot * stride_cs + d
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


def write_kv_config(head_dim: int) -> dict:
    return {"HEAD_DIM": head_dim, "BLOCK_D": triton.next_power_of_2(head_dim)}


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """Semantics:
        for t, slot in enumerate(slot_mapping):
            if slot >= 0:
                k_cache[:, slot // block_size, slot % block_size] = k[t]
                v_cache[:, slot // block_size, slot % block_size] = v[t]
    k, v: [num_tokens, num_kv_heads, head_dim]; caches: [num_kv_heads, num_blocks, block_size, head_dim]
    """
    num_tokens, num_kv_heads, head_dim = k.shape
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape == v_cache.shape
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and k.dtype == k_cache.dtype == v.dtype
    assert k_cache.shape[0] == num_kv_heads and k_cache.shape[3] == head_dim
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens, num_kv_heads)](
        k, v, k_cache, v_cache, slot_mapping, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(2), **write_kv_config(head_dim))
