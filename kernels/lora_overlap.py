"""A projection's GEMM with its LoRA. Where a graph step overlaps LoRA (LoraSegments.overlap), the shrink and the
expand (into the step's fp32 delta) run on a side stream beside the base GEMM, and the merge after the join: LoRA off
the critical path but for the merge. Eager steps run the GEMM, then the LoRA in place."""
from contextlib import nullcontext

import torch

from kernels.lora import lora_apply, lora_expand, lora_merge, lora_shrink, step_of
from kernels.reference import linear


def linear_lora(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, proj, segments) -> torch.Tensor:
    """Semantics: out = linear(x, weight, bias); lora_apply(x, proj, segments, out); return out
    Where the step overlaps LoRA (segments.overlap: a CUDA graph's steps), its shrink and expand run on a side
    stream beside the base GEMM, forked once x is ready, into the step's fp32 delta; lora_merge adds it after the
    join (the same bits as in place). On CPU the same launches run in turn."""
    step = step_of(segments, x, proj)
    if not step.overlap:
        out = linear(x, weight, bias)
        lora_apply(x, proj, segments, out)
        return out
    side = side_stream(x.device)
    if side is not None:
        side.wait_stream(torch.cuda.current_stream(x.device))
    with torch.cuda.stream(side) if side is not None else nullcontext():
        lora_expand(lora_shrink(x, proj, step), proj, step, None)
    out = linear(x, weight, bias)
    if side is not None:
        torch.cuda.current_stream(x.device).wait_stream(side)
    lora_merge(proj, step, out)
    return out


_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def side_stream(device: torch.device) -> "torch.cuda.Stream | None":
    """The stream LoRA runs on beside the GEMMs, one per CUDA device (None on CPU)."""
    if device.type != "cuda":
        return None
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return _SIDE_STREAMS[device]
