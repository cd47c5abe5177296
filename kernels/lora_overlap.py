"""A projection's GEMM with its LoRA. Where a graph step overlaps LoRA (LoraSegments.overlap), the shrink and the
expand (into the step's fp32 delta) run on a side stream beside the base GEMM; after the join either the merge adds
the delta, or (linear_lora_deferred, where the step folds) the op that reads the GEMM's output next adds it as it
loads it: LoRA off the critical path. Eager steps run the GEMM, then the LoRA in place."""
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from kernels.gemm import linear
from kernels.lora import lora_apply, lora_expand, lora_merge, lora_shrink, step_of


@dataclass(frozen=True, slots=True)
class LoraDelta:
    """A projection's LoRA product left for the next op: its input x becomes, on each row with an adapter,
    ((x.float() + delta) * m[slot]).to(x.dtype) (kernels.reference.add_lora_delta; the merge's bits)."""
    delta: torch.Tensor                       # [num_tokens, out_dim] fp32: whole rows where a token has an adapter
    m: torch.Tensor                           # [num_slots, out_dim]: DoRA magnitudes, 1 where a slot has none
    token_slots: torch.Tensor                 # [num_tokens] int32: each token's slot, -1 for none


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
    out = _beside(x, weight, bias, proj, step)
    lora_merge(proj, step, out)
    return out


def linear_lora_deferred(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, proj,
                         segments) -> tuple[torch.Tensor, LoraDelta | None]:
    """Semantics: out = linear(x, weight, bias); return out, LoraDelta(product of lora_expand, ...): the LoRA left
    for the op that reads out next (add_rms_norm, silu_and_mul, rotary_and_cache) where the step folds
    (segments.token_slots: graph steps with LoRA beside the GEMMs); else linear_lora(...), None."""
    step = step_of(segments, x, proj)
    if not step.overlap or segments.token_slots is None:
        return linear_lora(x, weight, bias, proj, segments), None
    out = _beside(x, weight, bias, proj, step)
    return out, LoraDelta(step.prepare(proj).delta, proj.m, segments.token_slots)


def _beside(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, proj, step) -> torch.Tensor:
    """The base GEMM, and the shrink and expand into the step's delta on the side stream (joined after)."""
    side = side_stream(x.device)
    if side is not None:
        side.wait_stream(torch.cuda.current_stream(x.device))
    with torch.cuda.stream(side) if side is not None else nullcontext():
        lora_expand(lora_shrink(x, proj, step), proj, step, None)
    out = linear(x, weight, bias)
    if side is not None:
        torch.cuda.current_stream(x.device).wait_stream(side)
    return out


_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def side_stream(device: torch.device) -> "torch.cuda.Stream | None":
    """The stream LoRA runs on beside the GEMMs, one per CUDA device (None on CPU)."""
    if device.type != "cuda":
        return None
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return _SIDE_STREAMS[device]
