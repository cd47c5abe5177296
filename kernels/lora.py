"""LoRA per projection: one shrink (h = x @ A^T) and one expand (out += h @ B^T) launch serve every module band of
a projection (qkv: q, k, v; gate_up: gate, up) for every adapter slot in the step.

A projection's slots (backend/lora/slots.Projection) hold band i's A in rank rows [i * max_rank, i * max_rank +
rank) and its B in the band's output columns [bounds[i], bounds[i + 1]) and the same rank columns. Each (band,
slot) runs at its own rank from a device table, ranks[band, slot]: programs past it exit at once, so mixed ranks
cost what they are, not the largest rank. Slot -1 is a segment with no adapter. For few tokens (decode steps)
the shrink splits the input dimension over SPLIT_K programs that write fp32 partial sums; the expand adds them.
"""
import os

import torch
import triton
import triton.language as tl

from kernels.metadata import UNSPECIALIZED_ARGS

DOT_FP32 = os.environ.get("TRITON_INTERPRET") == "1"       # see kernels/paged_attention.py


@triton.jit
def _segment(seg_starts_ptr, seg_slots_ptr, seg, m_block, BLOCK_M: tl.constexpr):
    """The slot and token rows [BLOCK_M] of block m_block of segment seg, their mask, and whether the program has
    nothing to do (no adapter, or no rows)."""
    slot = tl.load(seg_slots_ptr + seg)
    start = tl.load(seg_starts_ptr + seg)
    end = tl.load(seg_starts_ptr + seg + 1)
    offs_m = start + m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    return slot, offs_m, offs_m < end, (slot < 0) | (start + m_block * BLOCK_M >= end)


@triton.jit(do_not_specialize=UNSPECIALIZED_ARGS["_shrink_kernel"])
def _shrink_kernel(x_ptr, a_ptr, h_ptr, seg_starts_ptr, seg_slots_ptr, ranks_ptr, in_dim, cap, max_rank,
                   stride_xt, stride_as, stride_ar, stride_ak, stride_rb, stride_hs, stride_ht,
                   BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                   DOT_FP32: tl.constexpr):
    slot, offs_m, m_mask, idle = _segment(seg_starts_ptr, seg_slots_ptr, tl.program_id(0), tl.program_id(1), BLOCK_M)
    if idle:
        return
    r_block = tl.program_id(2) // SPLIT_K
    split = tl.program_id(2) % SPLIT_K
    offs_r = r_block * BLOCK_R + tl.arange(0, BLOCK_R)                 # rows of A: band offs_r // max_rank
    band_rank = tl.load(ranks_ptr + (offs_r // max_rank) * stride_rb + slot, mask=offs_r < cap, other=0)
    r_mask = (offs_r < cap) & (offs_r % max_rank < band_rank)
    if tl.sum(r_mask.to(tl.int32), 0) == 0:
        return
    k_per_split = tl.cdiv(tl.cdiv(in_dim, BLOCK_K), SPLIT_K) * BLOCK_K
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, in_dim)
    offs_k = tl.arange(0, BLOCK_K)
    x_rows = offs_m.to(tl.int64) * stride_xt
    a_slot = a_ptr + slot.to(tl.int64) * stride_as
    acc = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k_mask = k0 + offs_k < k_hi
        x = tl.load(x_ptr + x_rows[:, None] + (k0 + offs_k)[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)              # [BLOCK_M, BLOCK_K]
        a = tl.load(a_slot + offs_r[:, None] * stride_ar + (k0 + offs_k)[None, :] * stride_ak,
                    mask=r_mask[:, None] & k_mask[None, :], other=0.0)              # [BLOCK_R, BLOCK_K]
        a = a.to(x.dtype)                                                          # fp16 adapters, fp32 model
        if DOT_FP32:
            x = x.to(tl.float32)
            a = a.to(tl.float32)
        acc += tl.dot(x, tl.trans(a), input_precision="ieee")
    h_rows = split * stride_hs + offs_m.to(tl.int64) * stride_ht
    tl.store(h_ptr + h_rows[:, None] + offs_r[None, :], acc, mask=m_mask[:, None] & r_mask[None, :])


@triton.jit(do_not_specialize=UNSPECIALIZED_ARGS["_expand_kernel"])
def _expand_kernel(h_ptr, b_ptr, out_ptr, seg_starts_ptr, seg_slots_ptr, ranks_ptr, bounds_ptr, max_rank,
                   num_n_blocks, stride_hs, stride_ht, stride_bs, stride_bn, stride_bk, stride_rb, stride_ot,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, SPLIT_K: tl.constexpr,
                   DOT_FP32: tl.constexpr):
    slot, offs_m, m_mask, idle = _segment(seg_starts_ptr, seg_slots_ptr, tl.program_id(0), tl.program_id(1), BLOCK_M)
    if idle:
        return
    band = tl.program_id(2) // num_n_blocks
    rank = tl.load(ranks_ptr + band * stride_rb + slot)
    col_start = tl.load(bounds_ptr + band) + (tl.program_id(2) % num_n_blocks) * BLOCK_N
    col_end = tl.load(bounds_ptr + band + 1)
    if (rank == 0) | (col_start >= col_end):
        return
    offs_n = col_start + tl.arange(0, BLOCK_N)
    n_mask = offs_n < col_end
    offs_r = tl.arange(0, BLOCK_R)
    h_rows = offs_m.to(tl.int64) * stride_ht + band * max_rank
    b_slot = b_ptr + slot.to(tl.int64) * stride_bs + band * max_rank * stride_bk
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for r0 in range(0, rank, BLOCK_R):
        r_mask = r0 + offs_r < rank
        h_mask = m_mask[:, None] & r_mask[None, :]
        h = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
        for split in tl.static_range(SPLIT_K):                         # the shrink's partial sums
            h += tl.load(h_ptr + split * stride_hs + h_rows[:, None] + (r0 + offs_r)[None, :], mask=h_mask,
                         other=0.0)
        h = h.to(out_ptr.dtype.element_ty)                             # rounded as x @ A^T in x's dtype would be
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


def shrink_split_k(num_tokens: int, in_dim: int) -> int:
    """Input-dimension splits for the shrink: up to 8 for decode-sized steps (few tokens leave few programs, each
    streaming all of in_dim), each split at least 512 wide; none for prompt chunks."""
    if num_tokens > 64:
        return 1
    return max(1, min(8, in_dim // 512))


def shrink_config(in_dim: int, num_tokens: int) -> dict:
    return {"BLOCK_M": 16, "BLOCK_R": 16, "BLOCK_K": min(64, triton.next_power_of_2(in_dim)),
            "SPLIT_K": shrink_split_k(num_tokens, in_dim)}


def expand_config() -> dict:
    # BLOCK_R 16 matches the rank granularity; BLOCK_N 64 gives enough programs for the narrow o/down outputs
    return {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_R": 16}


def lora_shrink(x: torch.Tensor, proj, segments, split_k: int | None = None) -> torch.Tensor:
    """Semantics:
        for s, slot in enumerate(segments.slots):
            if slot >= 0:
                t = range(starts[s], starts[s + 1])
                for band i: r = ranks[i, slot]; rows = i * max_rank + arange(r)
                    h[:, t, rows] = split parts of x[t] @ proj.a[slot, rows].T     (h.sum(0) is the product)
    x: [num_tokens, in_dim]; proj.a: [num_slots, cap, in_dim] (x's dtype, or a narrower one: widened on load)
    -> h: [split_k, num_tokens, cap] fp32 (entries no segment covers are left unset: expand never reads them).
    """
    num_tokens, in_dim = x.shape
    cap = proj.a.shape[1]
    assert x.stride(1) == 1 and proj.a.shape[2] == in_dim and proj.a.dtype.itemsize <= x.dtype.itemsize
    cfg = shrink_config(in_dim, num_tokens)
    if split_k is not None:
        cfg["SPLIT_K"] = split_k
    h = torch.empty(cfg["SPLIT_K"], num_tokens, cap, dtype=torch.float32, device=x.device)
    grid = (len(segments.slots_list), triton.cdiv(segments.max_len, cfg["BLOCK_M"]),
            triton.cdiv(cap, cfg["BLOCK_R"]) * cfg["SPLIT_K"])
    if grid[0] and grid[1]:
        _shrink_kernel[grid](x, proj.a, h, segments.starts, segments.slots, proj.ranks, in_dim, cap, proj.max_rank,
                             x.stride(0), *proj.a.stride(), proj.ranks.stride(0), h.stride(0), h.stride(1),
                             DOT_FP32=DOT_FP32, **cfg)
    return h


def lora_expand(h: torch.Tensor, proj, segments, out: torch.Tensor) -> None:
    """Semantics:
        for s, slot in enumerate(segments.slots):
            if slot >= 0:
                t = range(starts[s], starts[s + 1])
                for band i: r = ranks[i, slot]; rows = i * max_rank + arange(r); cols = bounds[i]:bounds[i + 1]
                    out[t, cols] += h.sum(0)[t, rows] @ proj.b[slot, cols][:, rows].T
    h: lora_shrink's [split_k, num_tokens, cap]; proj.b: [num_slots, out_dim, cap]; out: [num_tokens, out_dim],
    updated in place.
    """
    assert out.stride(1) == 1 and h.stride(2) == 1 and proj.b.shape[1] == out.shape[1]
    cfg = expand_config()
    num_n_blocks = triton.cdiv(proj.max_width, cfg["BLOCK_N"])
    grid = (len(segments.slots_list), triton.cdiv(segments.max_len, cfg["BLOCK_M"]), proj.num_bands * num_n_blocks)
    if grid[0] and grid[1]:
        _expand_kernel[grid](h, proj.b, out, segments.starts, segments.slots, proj.ranks, proj.bounds, proj.max_rank,
                             num_n_blocks, h.stride(0), h.stride(1), *proj.b.stride(), proj.ranks.stride(0),
                             out.stride(0), SPLIT_K=h.shape[0], DOT_FP32=DOT_FP32, **cfg)
