"""A step's LoRA state for the Triton kernels (kernels/lora.py): each projection kind's launches, planned once
(kernels/lora_launch.py), and the intermediates they share."""
from dataclasses import dataclass, replace

import torch

from kernels.lora_launch import LoraLaunch, plan_launch
from kernels.metadata import DOT_FP32


@dataclass(slots=True)
class Prepared:
    """One projection's launches within a step: everything but the per-call tensors, made once."""
    launch: LoraLaunch
    h: torch.Tensor                           # [num_tokens, cap] view of the step's scratch
    partials: torch.Tensor                    # [split_k, num_tokens, cap] fp32 view
    delta: torch.Tensor | None                # [num_tokens, out_dim] fp32 view: the product, where LoRA overlaps
    shrink_ints: tuple                        # the shrink's integer arguments after stride_xt
    expand_ints: tuple                        # the expand's after stride_ot, stride_dt
    merge_ints: tuple                         # the merge's after stride_ot, stride_dt
    shrink_kwargs: dict
    expand_kwargs: dict
    merge_kwargs: dict


class LoraStep:
    """A step's work list, each projection's launches and the intermediates they share (every projection and layer
    runs after the last, on one stream or, overlapping, on the side stream between a fork and a join): h in x's
    dtype, the split partials, the per-item counters (zero between launches) and, where the step overlaps LoRA
    with the base GEMMs, the fp32 delta. Made at the step's first launch for every projection the step will run
    (`projections`: the runner passes one layer's; every layer's projection of a kind shares its shapes and
    strides), so a call does nothing in Python beyond its launches."""

    def __init__(self, work: torch.Tensor, block_m: int, num_tokens: int, dtype: torch.dtype, device,
                 projections: list, split_k: int | None = None, overlap: bool = False):
        self.work, self.block_m, self.num_tokens, self.split_k = work, block_m, num_tokens, split_k
        self.dtype, self.device, self.overlap = dtype, device, overlap
        self.counters = torch.zeros(work.shape[0], dtype=torch.int32, device=device)
        self.kinds: dict[tuple, tuple] = {}                    # key -> (launch, a projection of the kind)
        self.prepared: dict[tuple, Prepared] = {}
        for proj in projections:
            self.prepare(proj)

    @classmethod
    def for_segments(cls, segments, x: torch.Tensor, projections: list, split_k: int | None = None) -> "LoraStep":
        """Over the step's device work list (LoraFamily.segments of the Triton family built it)."""
        assert segments.work is not None, "segments without a work list: not the Triton family's"
        return cls(segments.work, segments.block_m, x.shape[0], x.dtype, x.device, projections, split_k,
                   segments.overlap)

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

    def relaunched(self, proj, **changes) -> Prepared:
        """proj's launches with their configuration changed (LoraLaunch fields: a sweep's, a test's), over the same
        intermediates; `use` puts them in place."""
        p = self.prepare(proj)
        return prepare_launch(replace(p.launch, **changes), proj, p.h, p.partials, p.delta)

    def use(self, proj, prepared: Prepared) -> None:
        """What the launchers run for proj's kind from now on."""
        self.prepared[self.kind(proj)] = prepared

    def _allocate(self) -> None:
        caps = {key: proj.num_bands * proj.max_rank for key, (_, proj) in self.kinds.items()}
        h = torch.empty(self.num_tokens, max(caps.values()), dtype=self.dtype, device=self.device)
        partials = torch.empty(max(launch.split_k * self.num_tokens * caps[key]
                                   for key, (launch, _) in self.kinds.items()), dtype=torch.float32,
                               device=self.device)
        delta = torch.empty(self.num_tokens * max(key[1] for key in self.kinds), dtype=torch.float32,
                            device=self.device) if self.overlap else None
        for key, (launch, proj) in self.kinds.items():
            cap = caps[key]
            h_view = h[:, :cap]
            part_view = partials[:launch.split_k * self.num_tokens * cap].view(launch.split_k, self.num_tokens, cap)
            delta_view = None if delta is None else delta[:self.num_tokens * key[1]].view(self.num_tokens, key[1])
            self.prepared[key] = prepare_launch(launch, proj, h_view, part_view, delta_view)


def prepare_launch(launch: LoraLaunch, proj, h: torch.Tensor, partials: torch.Tensor,
                   delta: torch.Tensor | None = None) -> Prepared:
    """A projection's launches at `launch` over its intermediates: h [num_tokens, cap], partials [split_k,
    num_tokens, cap] (fp32) and the delta [num_tokens, out_dim] (fp32, where LoRA overlaps the GEMM)."""
    shrink_ints = (launch.in_dim, proj.max_rank, launch.split_k, launch.blocks_per_split, *proj.a.stride(),
                   proj.ranks.stride(0), h.stride(0), partials.stride(0), partials.stride(1))
    expand_ints = (proj.max_rank, h.stride(0), *proj.b.stride(), proj.ranks.stride(0), proj.slot_bounds.stride(0),
                   proj.m.stride(0))
    merge_ints = (proj.ranks.stride(0), proj.slot_bounds.stride(0), proj.m.stride(0))
    return Prepared(launch, h, partials, delta, shrink_ints, expand_ints, merge_ints,
                    launch.shrink_constexprs | launch.shrink_options | {"DOT_FP32": DOT_FP32},
                    launch.expand_constexprs | launch.expand_options | {"DOT_FP32": DOT_FP32},
                    launch.merge_constexprs | launch.merge_options)
