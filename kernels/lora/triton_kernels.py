"""The Triton LoRA kernels and their launchers. One shrink (h = x @ A^T) and one expand (out += h @ B^T) launch
serve every module band of a projection (qkv: q, k, v; gate_up: gate, up) for every adapter slot in the step.

A step's tokens come as a work list: one item per BLOCK_M rows of a segment that has an adapter, [slot, start, end]
(kernels/lora/family.py builds it with the step's segments; graphs pad it with idle items). A projection's slots
(backend/lora/slots.Projection) hold band i's A in rank rows [i * max_rank, i * max_rank + rank) and its B in the
band's output columns and the same rank columns; each (band, slot) runs at its own rank from a device table, and a
slot's band bounds are its own (a fused qkv adapter is one band over every qkv column, its A stored once).

shrink: programs (item, split) each read one split of the input dimension for the item's rows and every band's A
        at the adapter's full rank in one tile (BLOCK_C covers num_bands x max_rank), tens of KB of A, x once,
        accumulating in fp32. With split_k > 1 each writes its fp32 partial; the last of an item to finish, counted
        by an atomic, sums every split in split order (deterministic: no atomic touches a value) and writes h in
        x's dtype. That program resets the counter, so the next launch (and a replayed graph) finds it at zero.
expand: programs (item, column group) each own TILES x BLOCK_N columns of one band of the output for the item's
        rows (the band from the slot's bounds) and walk the group's B tiles (pipelined). MMA: h's BLOCK_M rows
        loaded once, a tensor-core product per tile; else (decode items of a row or a few) each B tile read once
        into registers and multiplied with the item's rows one by one, a sum over the rank (no 16-row product for
        one row, a third of the registers). The epilogue adds the fp32 product into the output in place, scaled by
        the slot's DoRA magnitudes (1 where the slot has none, so a mixed batch of LoRA and DoRA is one pass), or
        (DELTA) stores it as it is into an fp32 delta, every column of an item's rows (0 in a band of rank 0).
merge:  programs (item, column group) over the delta, wider groups than the expand's but the same columns (each
        slot's bands with a rank): the same epilogue, in place (the same bits as the expand's own).
Graph steps run shrink and expand (DELTA) beside the base GEMM and the merge after it (TritonLoraExecutor,
kernels/lora/executor.py, which owns a step's launches). How each launches at a step's token count (work list,
tiles, splits, grids): kernels/lora/launch.py.
"""
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.lora.launch import LoraLaunch
from kernels.metadata import DOT_FP32, UNSPECIALIZED_ARGS


@triton.jit
def _work_item(work_ptr, item):
    """The item's slot and rows [start, end): three independent loads."""
    row = work_ptr + item * 3
    return tl.load(row), tl.load(row + 1), tl.load(row + 2)


@triton.jit(do_not_specialize=UNSPECIALIZED_ARGS["_shrink_kernel"])
def _shrink_kernel(x_ptr, a_ptr, h_ptr, part_ptr, count_ptr, work_ptr, ranks_ptr, stride_xt, in_dim, max_rank,
                   split_k, blocks_per_split, stride_as, stride_ar, stride_ak, stride_rb, stride_ht, stride_ps,
                   stride_pt, NUM_BANDS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
                   BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr, DOT_FP32: tl.constexpr):
    item = tl.program_id(0)
    split = tl.program_id(1)
    slot, start, end = _work_item(work_ptr, item)
    if slot < 0:
        return
    offs_c = tl.arange(0, BLOCK_C)                         # every band's rank rows: band c // BLOCK_R, rank c % BLOCK_R
    band = offs_c // BLOCK_R
    rank = tl.load(ranks_ptr + band * stride_rb + slot, mask=band < NUM_BANDS, other=0)
    c_mask = offs_c % BLOCK_R < rank
    if tl.max(c_mask.to(tl.int32), 0) == 0:
        return
    cols = band * max_rank + offs_c % BLOCK_R               # their rows of A, columns of h
    offs_m = start + tl.arange(0, BLOCK_M)
    m_mask = offs_m < end
    k_lo = split * blocks_per_split * BLOCK_K                  # a multiple of BLOCK_K: aligned, pipelined loads
    k_hi = tl.minimum(k_lo + blocks_per_split * BLOCK_K, in_dim)
    offs_k = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xt
    a_rows = a_ptr + slot.to(tl.int64) * stride_as + cols.to(tl.int64)[:, None] * stride_ar
    acc = tl.zeros([BLOCK_M, BLOCK_C], tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k_mask = k0 + offs_k < k_hi
        x = tl.load(x_rows + (k0 + offs_k)[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        a = tl.load(a_rows + (k0 + offs_k)[None, :] * stride_ak, mask=c_mask[:, None] & k_mask[None, :], other=0.0)
        a = a.to(x.dtype)                                                          # fp16 adapters, fp32 model
        if DOT_FP32:
            x = x.to(tl.float32)
            a = a.to(tl.float32)
        acc += tl.dot(x, tl.trans(a), input_precision="ieee")                     # [BLOCK_M, BLOCK_C]
    mask = m_mask[:, None] & c_mask[None, :]
    if split_k == 1:
        tl.store(h_ptr + offs_m.to(tl.int64)[:, None] * stride_ht + cols[None, :], acc.to(h_ptr.dtype.element_ty),
                 mask=mask)
    else:
        parts = part_ptr + offs_m.to(tl.int64)[:, None] * stride_pt + cols[None, :]
        tl.store(parts + split * stride_ps, acc, mask=mask)
        tl.debug_barrier()                                 # every thread's partial stored before the release
        if tl.atomic_add(count_ptr + item, 1, sem="acq_rel") == split_k - 1:       # the last split: sum them in order
            offs_r = tl.arange(0, BLOCK_R)
            for i in tl.static_range(NUM_BANDS):                                    # a band at a time: few registers
                rank_i = tl.load(ranks_ptr + i * stride_rb + slot)
                band_mask = m_mask[:, None] & (offs_r < rank_i)[None, :]
                band_parts = part_ptr + offs_m.to(tl.int64)[:, None] * stride_pt + (i * max_rank + offs_r)[None, :]
                total = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
                for s in range(0, split_k):
                    total += tl.load(band_parts + s * stride_ps, mask=band_mask, other=0.0, cache_modifier=".cg")
                tl.store(h_ptr + offs_m.to(tl.int64)[:, None] * stride_ht + (i * max_rank + offs_r)[None, :],
                         total.to(h_ptr.dtype.element_ty), mask=band_mask)
            tl.store(count_ptr + item, 0)


@triton.jit
def _group(bounds_ptr, ranks_ptr, slot, tile, stride_rb, NUM_BANDS: tl.constexpr, GROUP: tl.constexpr,
           ALIGNED: tl.constexpr):
    """Column group `tile` of the slot's bands (GROUP columns each): its band, the band's rank and its columns
    [group_start, col_end) (col_end: the band's end; group_start >= col_end where the slot has no such group)."""
    band = 0
    rank = tl.load(ranks_ptr + slot)
    col_end = tl.load(bounds_ptr + 1)
    if ALIGNED:                                            # every band whole groups: the group's columns at once
        group_start = tile * GROUP
        for i in tl.static_range(1, NUM_BANDS):            # the slot's band that holds them
            inside = group_start >= tl.load(bounds_ptr + i)
            band = tl.where(inside, i, band)
            rank = tl.where(inside, tl.load(ranks_ptr + i * stride_rb + slot), rank)
            col_end = tl.where(inside, tl.load(bounds_ptr + i + 1), col_end)
    else:                                                  # each band's own groups in band order, its last masked
        band_start = tl.load(bounds_ptr)
        first = 0                                          # the band's first group
        groups_before = 0
        for i in tl.static_range(1, NUM_BANDS):
            lo = tl.load(bounds_ptr + i)
            groups_before += tl.cdiv(lo - tl.load(bounds_ptr + i - 1), GROUP)
            inside = tile >= groups_before
            band = tl.where(inside, i, band)
            rank = tl.where(inside, tl.load(ranks_ptr + i * stride_rb + slot), rank)
            band_start = tl.where(inside, lo, band_start)
            col_end = tl.where(inside, tl.load(bounds_ptr + i + 1), col_end)
            first = tl.where(inside, groups_before, first)
        group_start = band_start + (tile - first) * GROUP
    return band, rank, group_start, col_end


@triton.jit
def _finish(acc, out_ptrs, delta_ptrs, scale, mask, DELTA: tl.constexpr):
    """The product acc (fp32) of a tile or a row: DELTA, as it is into the fp32 delta (lora_merge adds it later);
    else out = (out + acc) * scale in place (scale: DoRA magnitudes, 1 where the slot has none)."""
    if DELTA:
        tl.store(delta_ptrs, acc, mask=mask)
    else:
        base = tl.load(out_ptrs, mask=mask, other=0.0)
        tl.store(out_ptrs, ((base.to(tl.float32) + acc) * scale).to(out_ptrs.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=UNSPECIALIZED_ARGS["_expand_kernel"])
def _expand_kernel(h_ptr, b_ptr, out_ptr, delta_ptr, work_ptr, ranks_ptr, bounds_ptr, m_ptr, stride_ot, stride_dt,
                   max_rank, stride_ht, stride_bs, stride_bn, stride_bk, stride_rb, stride_bounds, stride_ms,
                   NUM_BANDS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TILES: tl.constexpr,
                   BLOCK_R: tl.constexpr, ALIGNED: tl.constexpr, MMA: tl.constexpr, DELTA: tl.constexpr,
                   DOT_FP32: tl.constexpr):
    item = tl.program_id(0)
    tile = tl.program_id(1)                                # a group of TILES tiles, within one band
    slot, start, end = _work_item(work_ptr, item)
    if slot < 0:
        return
    band, rank, group_start, col_end = _group(bounds_ptr + slot * stride_bounds, ranks_ptr, slot, tile, stride_rb,
                                              NUM_BANDS, TILES * BLOCK_N, ALIGNED)
    done = group_start >= col_end
    if not DELTA:                                          # (a delta's rows are whole: a band of rank 0 writes 0)
        done = done | (rank == 0)
    if done:
        return
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    b_rows = b_ptr + slot.to(tl.int64) * stride_bs + (band * max_rank + offs_r)[None, :] * stride_bk
    m_row = m_ptr + slot.to(tl.int64) * stride_ms                 # DoRA magnitudes of the slot (1: none)
    if MMA:                                                # a BLOCK_M-row tensor-core product per B tile
        offs_m = start + tl.arange(0, BLOCK_M)
        m_mask = offs_m < end
        h = tl.load(h_ptr + offs_m.to(tl.int64)[:, None] * stride_ht + (band * max_rank + offs_r)[None, :],
                    mask=m_mask[:, None] & r_mask[None, :], other=0.0)             # [BLOCK_M, BLOCK_R], once
        if DOT_FP32:
            h = h.to(tl.float32)
        for t in range(TILES):                             # B tiles pipelined (num_stages) along the group
            offs_n = group_start + t * BLOCK_N + tl.arange(0, BLOCK_N)
            n_mask = offs_n < col_end
            b = tl.load(b_rows + offs_n.to(tl.int64)[:, None] * stride_bn, mask=n_mask[:, None] & r_mask[None, :],
                        other=0.0)                                                 # [BLOCK_N, BLOCK_R]
            scale = tl.load(m_row + offs_n, mask=n_mask, other=1.0).to(tl.float32)
            acc = tl.dot(h, tl.trans(b.to(h.dtype)), input_precision="ieee")      # [BLOCK_M, BLOCK_N]
            _finish(acc, out_ptr + offs_m.to(tl.int64)[:, None] * stride_ot + offs_n[None, :],
                    delta_ptr + offs_m.to(tl.int64)[:, None] * stride_dt + offs_n[None, :], scale[None, :],
                    m_mask[:, None] & n_mask[None, :], DELTA)
    else:                                                  # rows one by one (decode items): a multiply-and-sum over
        for t in range(TILES):                             # the rank in registers, the B tile read once for them
            offs_n = group_start + t * BLOCK_N + tl.arange(0, BLOCK_N)
            n_mask = offs_n < col_end
            b = tl.load(b_rows + offs_n.to(tl.int64)[:, None] * stride_bn, mask=n_mask[:, None] & r_mask[None, :],
                        other=0.0).to(tl.float32)                                  # [BLOCK_N, BLOCK_R]
            scale = tl.load(m_row + offs_n, mask=n_mask, other=1.0).to(tl.float32)
            for i in range(0, end - start):
                row = start.to(tl.int64) + i
                h = tl.load(h_ptr + row * stride_ht + band * max_rank + offs_r, mask=r_mask,
                            other=0.0).to(tl.float32)                              # [BLOCK_R]
                acc = tl.sum(b * h[None, :], axis=1)                               # [BLOCK_N]
                _finish(acc, out_ptr + row * stride_ot + offs_n, delta_ptr + row * stride_dt + offs_n, scale, n_mask,
                        DELTA)


@triton.jit(do_not_specialize=UNSPECIALIZED_ARGS["_merge_kernel"])
def _merge_kernel(delta_ptr, out_ptr, work_ptr, ranks_ptr, bounds_ptr, m_ptr, stride_ot, stride_dt, stride_rb,
                  stride_bounds, stride_ms, NUM_BANDS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  TILES: tl.constexpr, ALIGNED: tl.constexpr):
    item = tl.program_id(0)
    tile = tl.program_id(1)                                # a group of TILES tiles, within one band
    slot, start, end = _work_item(work_ptr, item)
    if slot < 0:
        return
    band, rank, group_start, col_end = _group(bounds_ptr + slot * stride_bounds, ranks_ptr, slot, tile, stride_rb,
                                              NUM_BANDS, TILES * BLOCK_N, ALIGNED)
    if (rank == 0) | (group_start >= col_end):
        return
    offs_m = start + tl.arange(0, BLOCK_M)
    m_mask = offs_m < end
    m_row = m_ptr + slot.to(tl.int64) * stride_ms
    for t in range(TILES):
        offs_n = group_start + t * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < col_end
        mask = m_mask[:, None] & n_mask[None, :]
        acc = tl.load(delta_ptr + offs_m.to(tl.int64)[:, None] * stride_dt + offs_n[None, :], mask=mask, other=0.0)
        scale = tl.load(m_row + offs_n, mask=n_mask, other=1.0).to(tl.float32)
        _finish(acc, out_ptr + offs_m.to(tl.int64)[:, None] * stride_ot + offs_n[None, :], delta_ptr, scale[None, :],
                mask, False)


@dataclass(slots=True)
class Prepared:
    """One projection kind's launches within a step: everything but the per-call tensors, made once."""
    launch: LoraLaunch
    work: torch.Tensor                        # [num_items, 3] int32: the step's work list
    counters: torch.Tensor                    # [num_items] int32: the split-K counters, zero between launches
    h: torch.Tensor                           # [num_tokens, cap] view of the step's scratch
    partials: torch.Tensor                    # [split_k, num_tokens, cap] fp32 view
    delta: torch.Tensor | None                # [num_tokens, out_dim] fp32 view: the product, where LoRA overlaps
    shrink_ints: tuple                        # the shrink's integer arguments after stride_xt
    expand_ints: tuple                        # the expand's after stride_ot, stride_dt
    merge_ints: tuple                         # the merge's after stride_ot, stride_dt
    shrink_kwargs: dict
    expand_kwargs: dict
    merge_kwargs: dict


def prepare_launch(launch: LoraLaunch, proj, work: torch.Tensor, counters: torch.Tensor, h: torch.Tensor,
                   partials: torch.Tensor, delta: torch.Tensor | None = None) -> Prepared:
    """A projection's launches at `launch` over the step's work list and counters and its intermediates: h
    [num_tokens, cap], partials [split_k, num_tokens, cap] (fp32) and the delta [num_tokens, out_dim] (fp32, where
    LoRA overlaps the GEMM)."""
    shrink_ints = (launch.in_dim, proj.max_rank, launch.split_k, launch.blocks_per_split, *proj.a.stride(),
                   proj.ranks.stride(0), h.stride(0), partials.stride(0), partials.stride(1))
    expand_ints = (proj.max_rank, h.stride(0), *proj.b.stride(), proj.ranks.stride(0), proj.slot_bounds.stride(0),
                   proj.m.stride(0))
    merge_ints = (proj.ranks.stride(0), proj.slot_bounds.stride(0), proj.m.stride(0))
    return Prepared(launch, work, counters, h, partials, delta, shrink_ints, expand_ints, merge_ints,
                    launch.shrink_constexprs | launch.shrink_options | {"DOT_FP32": DOT_FP32},
                    launch.expand_constexprs | launch.expand_options | {"DOT_FP32": DOT_FP32},
                    launch.merge_constexprs | launch.merge_options)


def lora_shrink(x: torch.Tensor, proj, p: Prepared) -> torch.Tensor:
    """Semantics:
        for slot, start, end in p.work:
            if slot >= 0:
                t = range(start, end)
                for band i: r = ranks[i, slot]; rows = i * max_rank + arange(r)
                    h[t, rows] = (x[t].float() @ proj.a[slot, rows].T.float()).to(x.dtype)
    x: [num_tokens, in_dim]; proj.a: [num_slots, cap, in_dim] (x's dtype, or a narrower one: widened on load)
    -> h: [num_tokens, cap], p.h (entries no item covers are left unset: expand never reads them).
    """
    _shrink_kernel[p.launch.shrink_grid](x, proj.a, p.h, p.partials, p.counters, p.work, proj.ranks, x.stride(0),
                                         *p.shrink_ints, **p.shrink_kwargs)
    return p.h


def lora_expand(h: torch.Tensor, proj, p: Prepared, out: torch.Tensor | None) -> None:
    """Semantics:
        for slot, start, end in p.work:
            if slot >= 0:
                t = range(start, end)
                for band i with r = ranks[i, slot]: rows = i * max_rank + arange(r)
                    cols = bounds[slot, i]:bounds[slot, i + 1]
                    product = h[t, rows].float() @ proj.b[slot, cols][:, rows].T.float()
                    if out is None: p.delta[t, cols] = product                 (0 where r == 0)
                    else: out[t, cols] = (out[t, cols] + product) * proj.m[slot, cols]
    (proj.m: DoRA magnitudes, 1 where a slot has none: a DoRA module's whole output is scaled)
    h: lora_shrink's [num_tokens, cap]; proj.b: [num_slots, out_dim, cap]; out: [num_tokens, out_dim], updated in
    place, or None: the product into the step's fp32 delta, for lora_merge.
    """
    delta = out is None
    target = p.delta if delta else out
    _expand_kernel[p.launch.expand_grid](h, proj.b, target, target, p.work, proj.ranks, proj.slot_bounds, proj.m,
                                         target.stride(0), target.stride(0), *p.expand_ints, DELTA=delta,
                                         **p.expand_kwargs)


def lora_merge(proj, p: Prepared, out: torch.Tensor) -> None:
    """Semantics: over lora_expand's items and columns, out[t, cols] = (out[t, cols] + p.delta[t, cols]) *
    proj.m[slot, cols] (the same bits as lora_expand in place: the fp32 product, one rounding)."""
    _merge_kernel[p.launch.merge_grid](p.delta, out, p.work, proj.ranks, proj.slot_bounds, proj.m, out.stride(0),
                                        p.delta.stride(0), *p.merge_ints, **p.merge_kwargs)
