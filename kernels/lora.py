"""LoRA shrink (h = x @ A^T) and expand (out += h @ B^T) over token segments that share an adapter slot.

Each slot has its own rank per call (ranks[slot]); programs past a slot's rank exit at once, so mixed ranks cost
what they are (rounded up to BLOCK_R), not the largest rank. Slot -1 is a segment with no adapter. The engine
calls both once per module band of a projection (backend/lora/slots.py), on strided views of the slots.
"""
import os

import torch
import triton
import triton.language as tl

DOT_FP32 = os.environ.get("TRITON_INTERPRET") == "1"       # see kernels/paged_attention.py


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, h_ptr, seg_starts_ptr, seg_slots_ptr, ranks_ptr, in_dim,
                   stride_xt, stride_as, stride_ar, stride_ak, stride_ht,
                   BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, DOT_FP32: tl.constexpr):
    seg = tl.program_id(0)
    m_block = tl.program_id(1)
    r_block = tl.program_id(2)
    slot = tl.load(seg_slots_ptr + seg)
    if slot < 0:
        return
    rank = tl.load(ranks_ptr + slot)
    start = tl.load(seg_starts_ptr + seg)
    end = tl.load(seg_starts_ptr + seg + 1)
    if r_block * BLOCK_R >= rank or start + m_block * BLOCK_M >= end:
        return
    offs_m = start + m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_r = r_block * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < end
    r_mask = offs_r < rank
    x_rows = offs_m.to(tl.int64) * stride_xt
    a_slot = a_ptr + slot.to(tl.int64) * stride_as
    acc = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
    for k0 in range(0, in_dim, BLOCK_K):
        k_mask = k0 + offs_k < in_dim
        x = tl.load(x_ptr + x_rows[:, None] + (k0 + offs_k)[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)              # [BLOCK_M, BLOCK_K]
        a = tl.load(a_slot + offs_r[:, None] * stride_ar + (k0 + offs_k)[None, :] * stride_ak,
                    mask=r_mask[:, None] & k_mask[None, :], other=0.0)              # [BLOCK_R, BLOCK_K]
        a = a.to(x.dtype)                                                          # fp16 adapters, fp32 model
        if DOT_FP32:
            x = x.to(tl.float32)
            a = a.to(tl.float32)
        acc += tl.dot(x, tl.trans(a), input_precision="ieee")
    tl.store(h_ptr + offs_m.to(tl.int64)[:, None] * stride_ht + offs_r[None, :], acc.to(h_ptr.dtype.element_ty),
             mask=m_mask[:, None] & r_mask[None, :])


@triton.jit
def _expand_kernel(h_ptr, b_ptr, out_ptr, seg_starts_ptr, seg_slots_ptr, ranks_ptr, out_dim,
                   stride_ht, stride_bs, stride_bn, stride_bk, stride_ot,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, DOT_FP32: tl.constexpr):
    seg = tl.program_id(0)
    m_block = tl.program_id(1)
    n_block = tl.program_id(2)
    slot = tl.load(seg_slots_ptr + seg)
    if slot < 0:
        return
    rank = tl.load(ranks_ptr + slot)
    start = tl.load(seg_starts_ptr + seg)
    end = tl.load(seg_starts_ptr + seg + 1)
    if rank == 0 or start + m_block * BLOCK_M >= end:
        return
    offs_m = start + m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_R)
    m_mask = offs_m < end
    n_mask = offs_n < out_dim
    b_slot = b_ptr + slot.to(tl.int64) * stride_bs
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for r0 in range(0, rank, BLOCK_R):
        r_mask = r0 + offs_r < rank
        h = tl.load(h_ptr + offs_m.to(tl.int64)[:, None] * stride_ht + (r0 + offs_r)[None, :],
                    mask=m_mask[:, None] & r_mask[None, :], other=0.0)              # [BLOCK_M, BLOCK_R]
        b = tl.load(b_slot + offs_n[:, None] * stride_bn + (r0 + offs_r)[None, :] * stride_bk,
                    mask=n_mask[:, None] & r_mask[None, :], other=0.0)              # [BLOCK_N, BLOCK_R]
        b = b.to(h.dtype)
        if DOT_FP32:
            h = h.to(tl.float32)
            b = b.to(tl.float32)
        acc += tl.dot(h, tl.trans(b), input_precision="ieee")
    out_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_ot + offs_n[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    total = tl.load(out_ptrs, mask=mask, other=0.0).to(tl.float32) + acc
    tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=mask)


def shrink_config(in_dim: int) -> dict:
    return {"BLOCK_M": 16, "BLOCK_R": 16, "BLOCK_K": min(64, triton.next_power_of_2(in_dim))}


def expand_config(out_dim: int) -> dict:
    # BLOCK_R 16 matches the rank granularity; BLOCK_N 64 gives enough programs for the narrow o/down outputs
    return {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_R": 16}


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, segments, ranks: torch.Tensor,
                ranks_list: list[int]) -> torch.Tensor:
    """Semantics:
        for s, slot in enumerate(segments.slots):
            if slot >= 0:
                t = range(starts[s], starts[s + 1]); r = ranks[slot]
                h[t, :r] = x[t] @ lora_a[slot, :r].T
    x: [num_tokens, in_dim]; lora_a: [num_slots, cap, in_dim] (x's dtype, or a narrower one: widened on load);
    ranks: [num_slots] int32 -> h: [num_tokens, cap]
    (entries no segment covers are left unset: expand never reads them).
    """
    num_tokens, in_dim = x.shape
    assert x.stride(1) == 1 and lora_a.shape[2] == in_dim and lora_a.dtype.itemsize <= x.dtype.itemsize
    h = torch.empty(num_tokens, lora_a.shape[1], dtype=x.dtype, device=x.device)
    cfg = shrink_config(in_dim)
    grid = (len(segments.slots_list), triton.cdiv(segments.max_len, cfg["BLOCK_M"]),
            triton.cdiv(lora_a.shape[1], cfg["BLOCK_R"]))
    if grid[0] and grid[1]:
        _shrink_kernel[grid](x, lora_a, h, segments.starts, segments.slots, ranks, in_dim, x.stride(0),
                             *lora_a.stride(), h.stride(0), DOT_FP32=DOT_FP32, **cfg)
    return h


def lora_expand(h: torch.Tensor, lora_b: torch.Tensor, segments, ranks: torch.Tensor, ranks_list: list[int],
                out: torch.Tensor) -> None:
    """Semantics:
        for s, slot in enumerate(segments.slots):
            if slot >= 0:
                t = range(starts[s], starts[s + 1]); r = ranks[slot]
                out[t] += h[t, :r] @ lora_b[slot, :, :r].T
    h: [num_tokens, cap]; lora_b: [num_slots, out_dim, cap]; out: [num_tokens, out_dim], updated in place.
    """
    out_dim = out.shape[1]
    assert out.stride(1) == 1 and h.stride(1) == 1 and lora_b.shape[1] == out_dim
    cfg = expand_config(out_dim)
    grid = (len(segments.slots_list), triton.cdiv(segments.max_len, cfg["BLOCK_M"]),
            triton.cdiv(out_dim, cfg["BLOCK_N"]))
    if grid[0] and grid[1]:
        _expand_kernel[grid](h, lora_b, out, segments.starts, segments.slots, ranks, out_dim, h.stride(0),
                             *lora_b.stride(), out.stride(0), DOT_FP32=DOT_FP32, **cfg)
