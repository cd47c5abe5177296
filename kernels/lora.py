"""LoRA per projection: one shrink (h = x @ A^T) and one expand (out += h @ B^T) launch serve every module band of
a projection (qkv: q, k, v; gate_up: gate, up) for every adapter slot in the step.

A step's tokens come as a work list: one item per BLOCK_M rows of a segment that has an adapter, [slot, start, end]
(kernels/lora_family.py builds it with the step's segments; graphs pad it with idle items). A projection's slots
(backend/lora/slots.Projection) hold band i's A in rank rows [i * max_rank, i * max_rank + rank) and its B in the
band's output columns and the same rank columns; each (band, slot) runs at its own rank from a device table, and a
slot's band bounds are its own (a fused qkv adapter is one band over every qkv column, its A stored once).

shrink: programs (item, split) each read one split of the input dimension for the item's rows and every band's A
        at the adapter's full rank in one tile (BLOCK_C covers num_bands x max_rank), tens of KB of A, x once,
        accumulating in fp32. With split_k > 1 each writes its fp32 partial; the last of an item to finish, counted
        by an atomic, sums every split in split order (deterministic: no atomic touches a value) and writes h in
        x's dtype. That program resets the counter, so the next launch (and a replayed graph) finds it at zero.
expand: programs (item, column group) each own TILES x BLOCK_N columns of one band of the output for the item's
        rows (the band from the slot's bounds), load h once and walk the group's B tiles (pipelined), adding the
        product into the output in place; the epilogue scales the sum by the slot's DoRA magnitudes (1 where the
        slot has none, so a mixed batch of LoRA and DoRA is one pass).
How each launches at a step's token count (work list, tiles, splits, grids): kernels/lora_launch.py.
"""
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.lora_launch import LoraLaunch, plan_launch
from kernels.metadata import UNSPECIALIZED_ARGS

DOT_FP32 = os.environ.get("TRITON_INTERPRET") == "1"       # see kernels/paged_attention.py


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


@triton.jit(do_not_specialize=UNSPECIALIZED_ARGS["_expand_kernel"])
def _expand_kernel(h_ptr, b_ptr, out_ptr, work_ptr, ranks_ptr, bounds_ptr, m_ptr, stride_ot, max_rank, stride_ht,
                   stride_bs, stride_bn, stride_bk, stride_rb, stride_bounds, stride_ms, NUM_BANDS: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TILES: tl.constexpr, BLOCK_R: tl.constexpr,
                   ALIGNED: tl.constexpr, DOT_FP32: tl.constexpr):
    item = tl.program_id(0)
    tile = tl.program_id(1)                                # a group of TILES tiles, within one band
    slot, start, end = _work_item(work_ptr, item)
    if slot < 0:
        return
    bounds = bounds_ptr + slot * stride_bounds
    band = 0
    rank = tl.load(ranks_ptr + slot)
    col_end = tl.load(bounds + 1)
    if ALIGNED:                                            # every band whole groups: the group's columns at once
        group_start = tile * (TILES * BLOCK_N)
        for i in tl.static_range(1, NUM_BANDS):            # the slot's band that holds them
            inside = group_start >= tl.load(bounds + i)
            band = tl.where(inside, i, band)
            rank = tl.where(inside, tl.load(ranks_ptr + i * stride_rb + slot), rank)
            col_end = tl.where(inside, tl.load(bounds + i + 1), col_end)
    else:                                                  # each band's own groups in band order, its last masked
        band_start = tl.load(bounds)
        first = 0                                          # the band's first group
        groups_before = 0
        for i in tl.static_range(1, NUM_BANDS):
            lo = tl.load(bounds + i)
            groups_before += tl.cdiv(lo - tl.load(bounds + i - 1), TILES * BLOCK_N)
            inside = tile >= groups_before
            band = tl.where(inside, i, band)
            rank = tl.where(inside, tl.load(ranks_ptr + i * stride_rb + slot), rank)
            band_start = tl.where(inside, lo, band_start)
            col_end = tl.where(inside, tl.load(bounds + i + 1), col_end)
            first = tl.where(inside, groups_before, first)
        group_start = band_start + (tile - first) * (TILES * BLOCK_N)
    if (rank == 0) | (group_start >= col_end):
        return
    offs_m = start + tl.arange(0, BLOCK_M)
    m_mask = offs_m < end
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    h = tl.load(h_ptr + offs_m.to(tl.int64)[:, None] * stride_ht + (band * max_rank + offs_r)[None, :],
                mask=m_mask[:, None] & r_mask[None, :], other=0.0)                 # [BLOCK_M, BLOCK_R], once
    if DOT_FP32:
        h = h.to(tl.float32)
    b_rows = b_ptr + slot.to(tl.int64) * stride_bs + (band * max_rank + offs_r)[None, :] * stride_bk
    m_row = m_ptr + slot.to(tl.int64) * stride_ms                 # DoRA magnitudes of the slot (1: none)
    out_rows = out_ptr + offs_m.to(tl.int64)[:, None] * stride_ot
    for t in range(TILES):                                 # B tiles pipelined (num_stages) along the group
        offs_n = group_start + t * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < col_end
        b = tl.load(b_rows + offs_n.to(tl.int64)[:, None] * stride_bn, mask=n_mask[:, None] & r_mask[None, :],
                    other=0.0)                                                     # [BLOCK_N, BLOCK_R]
        mask = m_mask[:, None] & n_mask[None, :]
        base = tl.load(out_rows + offs_n[None, :], mask=mask, other=0.0)
        scale = tl.load(m_row + offs_n, mask=n_mask, other=1.0).to(tl.float32)
        b = b.to(h.dtype)
        acc = tl.dot(h, tl.trans(b), input_precision="ieee")                       # [BLOCK_M, BLOCK_N]
        total = (base.to(tl.float32) + acc) * scale[None, :]                      # DoRA: the whole output scaled
        tl.store(out_rows + offs_n[None, :], total.to(out_ptr.dtype.element_ty), mask=mask)


@dataclass(slots=True)
class Prepared:
    """One projection's launches within a step: everything but the per-call tensors, made once."""
    launch: LoraLaunch
    h: torch.Tensor                           # [num_tokens, cap] view of the step's scratch
    partials: torch.Tensor                    # [split_k, num_tokens, cap] fp32 view
    shrink_ints: tuple                        # the shrink's integer arguments after stride_xt
    expand_ints: tuple                        # the expand's after stride_ot
    shrink_kwargs: dict
    expand_kwargs: dict


class LoraStep:
    """A step's work list, each projection's launches and the intermediates they share (every projection and layer
    runs after the last on one stream): h in x's dtype, the split partials, and the per-item counters, zero
    between launches. Made at the step's first launch for every projection the step will run (`projections`: the
    runner passes one layer's; every layer's projection of a kind shares its shapes and strides), so a call does
    nothing in Python beyond its two launches."""

    def __init__(self, work: torch.Tensor, block_m: int, num_tokens: int, dtype: torch.dtype, device,
                 projections: list, split_k: int | None = None):
        self.work, self.block_m, self.num_tokens, self.split_k = work, block_m, num_tokens, split_k
        self.dtype, self.device = dtype, device
        self.counters = torch.zeros(work.shape[0], dtype=torch.int32, device=device)
        self.kinds: dict[tuple, tuple] = {}                    # key -> (launch, a projection of the kind)
        self.prepared: dict[tuple, Prepared] = {}
        for proj in projections:
            self.prepare(proj)

    @classmethod
    def for_segments(cls, segments, x: torch.Tensor, projections: list, split_k: int | None = None) -> "LoraStep":
        """Over the step's device work list (LoraFamily.segments of the Triton family built it)."""
        assert segments.work is not None, "segments without a work list: not the Triton family's"
        return cls(segments.work, segments.block_m, x.shape[0], x.dtype, x.device, projections, split_k)

    @staticmethod
    def kind(proj) -> tuple:
        """Projections of a kind share their shapes and strides, and so their launches."""
        return proj.a.shape[2], proj.b.shape[1], proj.num_bands

    def prepare(self, proj) -> Prepared:
        key = self.kind(proj)
        prepared = self.prepared.get(key)
        if prepared is None:                                  # a kind first seen: plan it, size the scratch again
            launch = plan_launch(self.num_tokens, self.work.shape[0], key[0], proj.widths, proj.max_rank,
                                 self.block_m, self.split_k, self.dtype.itemsize)
            self.kinds[key] = (launch, proj)
            self._allocate()
            prepared = self.prepared[key]
        return prepared

    def _allocate(self) -> None:
        caps = {key: proj.num_bands * proj.max_rank for key, (_, proj) in self.kinds.items()}
        h = torch.empty(self.num_tokens, max(caps.values()), dtype=self.dtype, device=self.device)
        partials = torch.empty(max(launch.split_k * self.num_tokens * caps[key]
                                   for key, (launch, _) in self.kinds.items()), dtype=torch.float32,
                               device=self.device)
        for key, (launch, proj) in self.kinds.items():
            cap = caps[key]
            h_view = h[:, :cap]
            part_view = partials[:launch.split_k * self.num_tokens * cap].view(launch.split_k, self.num_tokens, cap)
            self.prepared[key] = prepare_launch(launch, proj, h_view, part_view)


def prepare_launch(launch: LoraLaunch, proj, h: torch.Tensor, partials: torch.Tensor) -> Prepared:
    """A projection's launches at `launch` over its intermediates: h [num_tokens, cap], partials [split_k,
    num_tokens, cap] (fp32)."""
    shrink_ints = (launch.in_dim, proj.max_rank, launch.split_k, launch.blocks_per_split, *proj.a.stride(),
                   proj.ranks.stride(0), h.stride(0), partials.stride(0), partials.stride(1))
    expand_ints = (proj.max_rank, h.stride(0), *proj.b.stride(), proj.ranks.stride(0), proj.slot_bounds.stride(0),
                   proj.m.stride(0))
    return Prepared(launch, h, partials, shrink_ints, expand_ints,
                    launch.shrink_constexprs | launch.shrink_options | {"DOT_FP32": DOT_FP32},
                    launch.expand_constexprs | launch.expand_options | {"DOT_FP32": DOT_FP32})


def lora_shrink(x: torch.Tensor, proj, step: LoraStep) -> torch.Tensor:
    """Semantics:
        for slot, start, end in work:
            if slot >= 0:
                t = range(start, end)
                for band i: r = ranks[i, slot]; rows = i * max_rank + arange(r)
                    h[t, rows] = (x[t].float() @ proj.a[slot, rows].T.float()).to(x.dtype)
    x: [num_tokens, in_dim]; proj.a: [num_slots, cap, in_dim] (x's dtype, or a narrower one: widened on load)
    -> h: [num_tokens, cap], the step's (entries no item covers are left unset: expand never reads them).
    """
    p = step.prepare(proj)
    _shrink_kernel[p.launch.shrink_grid](x, proj.a, p.h, p.partials, step.counters, step.work, proj.ranks,
                                         x.stride(0), *p.shrink_ints, **p.shrink_kwargs)
    return p.h


def lora_expand(h: torch.Tensor, proj, step: LoraStep, out: torch.Tensor) -> None:
    """Semantics:
        for slot, start, end in work:
            if slot >= 0:
                t = range(start, end)
                for band i: r = ranks[i, slot]; rows = i * max_rank + arange(r)
                    cols = bounds[slot, i]:bounds[slot, i + 1]
                    out[t, cols] = (out[t, cols] + h[t, rows] @ proj.b[slot, cols][:, rows].T) * proj.m[slot, cols]
    (proj.m: DoRA magnitudes, 1 where a slot has none: a DoRA module's whole output is scaled)
    h: lora_shrink's [num_tokens, cap]; proj.b: [num_slots, out_dim, cap]; out: [num_tokens, out_dim], updated in
    place.
    """
    p = step.prepare(proj)
    _expand_kernel[p.launch.expand_grid](h, proj.b, out, step.work, proj.ranks, proj.slot_bounds, proj.m,
                                         out.stride(0), *p.expand_ints, **p.expand_kwargs)


def lora_apply(x: torch.Tensor, proj, segments, out: torch.Tensor) -> None:
    """Semantics: kernels.reference.lora_apply, in two launches for all the projection's bands (shrink, expand).
    The step's state is made at its first call and kept on the segments (`projections`: what the step runs, so
    that it is sized once)."""
    if segments.step is None:
        segments.step = LoraStep.for_segments(segments, x, segments.projections or [proj])
    lora_expand(lora_shrink(x, proj, segments.step), proj, segments.step, out)


if __name__ == "__main__":
    from kernels.lora_plan import main
    main()
