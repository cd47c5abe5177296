"""LoRA per projection: one shrink (h = x @ A^T) and one expand (out += h @ B^T) launch serve every module band of
a projection (qkv: q, k, v; gate_up: gate, up) for every adapter slot in the step.

A step's tokens come as a work list: one item per BLOCK_M rows of a segment that has an adapter, [slot, start, end]
(backend/lora/batch.py builds it with the step's segments; graphs pad it with idle items). A projection's slots
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
`LoraLaunch` is a projection's configuration at a step's token count: the launchers and the cost plan
(kernels/lora_plan.py) both use it.
"""
import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.metadata import UNSPECIALIZED_ARGS

DOT_FP32 = os.environ.get("TRITON_INTERPRET") == "1"       # see kernels/paged_attention.py
WORK_FIELDS = 3                                             # a work item: slot, first row, end row
TARGET_PROGRAMS = 512                                       # a shrink launch's programs: <= ~1 wave at its occupancy
SPLIT_COLUMNS_PER_ROW = 16                                  # a split's columns per row of its item: its fp32 partial
                                                            # (written, read back) stays <= 1/8 of the A it reads
MAX_PARTIAL_BYTES = 64 << 20                                # the split partials of one launch, fp32
EXPAND_GROUP = 512                                          # output columns of one expand program (at most)


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
                   DOT_FP32: tl.constexpr):
    item = tl.program_id(0)
    group_start = tl.program_id(1) * (TILES * BLOCK_N)     # TILES tiles of one band (widths are multiples of it)
    slot, start, end = _work_item(work_ptr, item)
    if slot < 0:
        return
    bounds = bounds_ptr + slot * stride_bounds
    band = 0
    rank = tl.load(ranks_ptr + slot)
    col_end = tl.load(bounds + 1)
    for i in tl.static_range(1, NUM_BANDS):                # the slot's band that holds this group's columns
        inside = group_start >= tl.load(bounds + i)
        band = tl.where(inside, i, band)
        rank = tl.where(inside, tl.load(ranks_ptr + i * stride_rb + slot), rank)
        col_end = tl.where(inside, tl.load(bounds + i + 1), col_end)
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


def block_m_for(num_tokens: int, dtype: torch.dtype = torch.bfloat16) -> int:
    """Rows per work item: 16 for decode steps and short chunks (segments of a few tokens), 64 for long prompt
    chunks of a 16-bit model (fewer re-reads of each A; fp32 tiles that tall would spill)."""
    return 64 if num_tokens > 256 and dtype.itemsize <= 2 else 16


def max_work_items(num_tokens: int, num_segments: int, block_m: int) -> int:
    """The most items num_tokens rows in num_segments segments can make (a graph's fixed work-list length)."""
    return max(1, min(num_tokens, num_segments + num_tokens // block_m))


def work_items(starts: list[int], slots: list[int], block_m: int, num_items: int | None = None) -> torch.Tensor:
    """[num_items, 3] int32 host tensor: [slot, start, end) per block_m rows of each segment with an adapter, then
    idle items ([-1, 0, 0]) up to num_items."""
    items = [(slot, row, min(row + block_m, starts[s + 1])) for s, slot in enumerate(slots) if slot >= 0
             for row in range(starts[s], starts[s + 1], block_m)]
    num_items = max(1, len(items)) if num_items is None else num_items
    assert len(items) <= num_items, f"{len(items)} LoRA work items exceed the {num_items} a graph holds"
    return torch.tensor(items + [(-1, 0, 0)] * (num_items - len(items)), dtype=torch.int32).view(num_items, 3)


@dataclass(frozen=True, slots=True)
class LoraLaunch:
    """One projection's shrink and expand at a step's token count."""
    num_items: int
    num_bands: int
    in_dim: int
    out_dim: int
    max_rank: int
    block_m: int
    block_r: int                              # max_rank, as a power of two
    block_k: int
    split_k: int
    blocks_per_split: int                     # BLOCK_K blocks of the input each split reads
    block_n: int
    tiles: int                                # BLOCK_N tiles an expand program covers
    act_bytes: int = 2                        # the activations' element size

    @property
    def block_c(self) -> int:
        return triton.next_power_of_2(self.num_bands * self.block_r)

    @property
    def k_per_split(self) -> int:
        return self.blocks_per_split * self.block_k

    @property
    def shrink_grid(self) -> tuple[int, int]:
        return self.num_items, self.split_k

    @property
    def expand_grid(self) -> tuple[int, int]:
        return self.num_items, triton.cdiv(self.out_dim, self.block_n * self.tiles)

    @property
    def shrink_constexprs(self) -> dict:
        return {"NUM_BANDS": self.num_bands, "BLOCK_M": self.block_m, "BLOCK_R": self.block_r,
                "BLOCK_C": self.block_c, "BLOCK_K": self.block_k}

    @property
    def expand_constexprs(self) -> dict:
        return {"NUM_BANDS": self.num_bands, "BLOCK_M": self.block_m, "BLOCK_N": self.block_n, "TILES": self.tiles,
                "BLOCK_R": self.block_r}

    @property
    def shrink_options(self) -> dict:
        """Four warps, eight for tiles past 4096 accumulators (64 rows of 128 columns, 16 of 512: registers); the K
        loop's loads pipelined three deep."""
        return {"num_warps": 8 if self.block_m * self.block_c > 4096 else 4, "num_stages": 3}

    @property
    def expand_options(self) -> dict:
        """The group's B tiles pipelined two deep behind the product of the one before."""
        return {"num_warps": 4, "num_stages": 2}


def plan_launch(num_tokens: int, num_items: int, in_dim: int, widths: list[int], max_rank: int,
                block_m: int | None = None, split_k: int | None = None, act_bytes: int = 2) -> LoraLaunch:
    """The configuration a projection runs with: full-rank tiles (BLOCK_R >= max_rank; every band in one shrink
    tile, x read once), the input split so that up to TARGET_PROGRAMS shrink programs each read >=
    SPLIT_COLUMNS_PER_ROW x BLOCK_M columns (or into split_k parts, for tests), and expand programs over groups
    of columns as wide as the bands' common divisor allows (a group never straddles two bands). Tiles hold half as
    many fp32 activations (act_bytes 4: an fp32 model) as 16-bit ones, in the same registers."""
    block_m = block_m or block_m_for(num_tokens)
    block_r = max(16, triton.next_power_of_2(max_rank))
    block_c = triton.next_power_of_2(len(widths) * block_r)
    block_k = min(128 if act_bytes <= 2 else 64, max(16, (8192 if act_bytes <= 2 else 2048) // block_c),
                  max(16, triton.next_power_of_2(in_dim)))
    num_bands, cap = len(widths), len(widths) * max_rank
    k_blocks = triton.cdiv(in_dim, block_k)
    split_k = split_k or min(triton.cdiv(TARGET_PROGRAMS, num_items),
                             max(1, in_dim // (SPLIT_COLUMNS_PER_ROW * block_m)),
                             max(1, MAX_PARTIAL_BYTES // (num_tokens * cap * 4)))
    blocks_per_split = triton.cdiv(k_blocks, max(1, split_k))
    split_k = triton.cdiv(k_blocks, blocks_per_split)                 # no split left without columns
    block_n, tiles = expand_tiles(widths, block_m, block_r, act_bytes)
    return LoraLaunch(num_items, num_bands, in_dim, sum(widths), max_rank, block_m, block_r, block_k, split_k,
                      blocks_per_split, block_n, tiles, act_bytes)


def expand_tiles(widths: list[int], block_m: int, block_r: int, act_bytes: int = 2) -> tuple[int, int]:
    """(BLOCK_N, TILES): an expand program's group of TILES x BLOCK_N columns is the widest power of two (up to
    EXPAND_GROUP) dividing every band's width; its tiles as wide as an fp32 [BLOCK_M, BLOCK_N] accumulator and a
    [BLOCK_N, BLOCK_R] B tile keep in few registers (128 columns at rank 64 and 16 rows)."""
    divides = math.gcd(*widths) & -math.gcd(*widths)                 # the largest power of two dividing them
    if divides < 16:
        raise ValueError(f"LoRA band widths {widths} must be multiples of 16 for the Triton expand")
    group = min(divides, EXPAND_GROUP)
    block_n = min(group, max(16, 2048 // block_m), max(16, 8192 // block_r // (2 if act_bytes > 2 else 1)))
    return block_n, group // block_n


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
        """From the runner's device work list, or (a caller without one: tests, the self-check) made here."""
        if segments.work is not None:
            return cls(segments.work, segments.block_m, x.shape[0], x.dtype, x.device, projections, split_k)
        block_m = block_m_for(x.shape[0], x.dtype)
        work = work_items(segments.starts_list, segments.slots_list, block_m).to(x.device)
        return cls(work, block_m, x.shape[0], x.dtype, x.device, projections, split_k)

    def prepare(self, proj) -> Prepared:
        key = (proj.a.shape[2], proj.b.shape[1], proj.num_bands)
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
            shrink_ints = (launch.in_dim, proj.max_rank, launch.split_k, launch.blocks_per_split, *proj.a.stride(),
                           proj.ranks.stride(0), h_view.stride(0), part_view.stride(0), part_view.stride(1))
            expand_ints = (proj.max_rank, h_view.stride(0), *proj.b.stride(), proj.ranks.stride(0),
                           proj.slot_bounds.stride(0), proj.m.stride(0))
            self.prepared[key] = Prepared(
                launch, h_view, part_view, shrink_ints, expand_ints,
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
    The step's state is made at its first call and kept on the segments (`projections`: the runner's list of
    what the step runs, so that it is sized once)."""
    state = segments.kernel_state
    if "step" not in state:
        state["step"] = LoraStep.for_segments(segments, x, state.get("projections", [proj]))
    step = state["step"]
    lora_expand(lora_shrink(x, proj, step), proj, step, out)


if __name__ == "__main__":
    from kernels.lora_plan import main
    main()
