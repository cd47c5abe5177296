"""A step's LoRA: the one object the model's layers call for it (LlamaModel.project, the mixture's layers), one
class per kernel backend, made for each step over its segments (kernels/lora/segments.py) and the device slots'
projections (backend/lora/slots.py). Each call is a projection's GEMM with every module band's LoRA of it.

    LoraExecutor        the torch reference's: the backend's GEMM, then kernels/lora/reference.lora_apply
    CpuLoraExecutor     the compiled CPU kernels': over fp32 column panels one call whose GEMM prefetches the adapter
                        rows the LoRA after it reads (kernels/cpu_ext.linear_lora); else the GEMM, then
                        cpu_ext.lora_apply
    TritonLoraExecutor  the Triton kernels' (kernels/lora/triton_kernels.py): the step's work list, each projection
                        kind's launches planned once and their scratch; where a graph step overlaps LoRA, its shrink
                        and expand on a side stream beside the base GEMM into an fp32 delta, then either the merge
                        adds the delta or (linear_deferred, where the step folds) the op that reads the GEMM's output
                        next adds it as it loads it: LoRA off the critical path
Every executor also adds a mixture's expert LoRA (the experts', a router's, a shared expert gate's)."""
from contextlib import nullcontext
from dataclasses import dataclass, replace

import torch

from kernels import cpu_ext
from kernels.lora import reference
from kernels.lora.launch import plan_launch
from kernels.lora.segments import LoraSegments
from kernels.lora.triton_kernels import Prepared, lora_expand, lora_merge, lora_shrink, prepare_launch
from kernels.metadata import ExpertLora
from kernels.quant import QUANTIZED_WEIGHTS


@dataclass(frozen=True, slots=True)
class LoraDelta:
    """A projection's LoRA product left for the next op: its input x becomes, on each row with an adapter,
    ((x.float() + delta) * m[slot]).to(x.dtype) (kernels/lora/reference.add_lora_delta; the merge's bits)."""
    delta: torch.Tensor                       # [num_tokens, out_dim] fp32: whole rows where a token has an adapter
    m: torch.Tensor                           # [num_slots, out_dim]: DoRA magnitudes, 1 where a slot has none
    token_slots: torch.Tensor                 # [num_tokens] int32: each token's slot, -1 for none


class LoraExecutor:
    """A step's LoRA by the torch reference (every backend's oracle). ops: the kernel backend (its GEMM `linear`,
    `slot_lora`); segments: the step's, on the device; projections: per layer, each projection's slots
    (backend/lora/slots.Projection); experts: the slots' expert modules (backend/lora/expert_slots.py), None for a
    dense model."""

    def __init__(self, ops, segments: LoraSegments, projections: list[dict], experts=None):
        self.ops, self.segments, self.projections, self.expert_slots = ops, segments, projections, experts
        self._token_slots: torch.Tensor | None = None

    def linear(self, x: torch.Tensor, weight, bias: torch.Tensor | None, layer: int, name: str) -> torch.Tensor:
        """Semantics: out = linear(x, weight, bias); apply(x, projections[layer][name], out); return out."""
        out = self.ops.linear(x, weight, bias)
        self.apply(x, self.projections[layer][name], out)
        return out

    def linear_deferred(self, x: torch.Tensor, weight, bias: torch.Tensor | None, layer: int,
                        name: str) -> tuple[torch.Tensor, LoraDelta | None]:
        """(the GEMM, the LoRA product the op after it adds) where the step folds (TritonLoraExecutor); else
        (linear(...), None)."""
        return self.linear(x, weight, bias, layer, name), None

    def apply(self, x: torch.Tensor, proj, out: torch.Tensor) -> None:
        """Semantics: out += expand(shrink(x)) of every band of proj, then out[tokens of a DoRA slot] *= proj.m[slot]
        (kernels/lora/reference.lora_apply)."""
        reference.lora_apply(x, proj, self.segments, out)

    def token_slots(self, num_tokens: int) -> torch.Tensor:
        """[num_tokens] int32 on the device: each token's slot, -1 for none (from the segments, no host sync)."""
        if self._token_slots is None:
            s = self.segments
            self._token_slots = torch.repeat_interleave(s.slots, s.starts[1:] - s.starts[:-1], output_size=num_tokens)
        return self._token_slots

    def has_experts(self) -> bool:
        """A slot of the step holds expert modules (13-17). A graph's step, whose slots the host does not know when
        it is recorded, runs them whatever its slots hold."""
        experts, s = self.expert_slots, self.segments
        if experts is None:
            return False
        recorded = s.starts_list[-1] == 0
        return recorded or any(slot >= 0 and experts.loaded[slot] for slot in s.slots_list)

    def experts(self, layer: int, x: torch.Tensor, top_k: int) -> ExpertLora | None:
        """Layer `layer`'s expert LoRA for the step's (token, expert) rows (x: the layer's input), or None where no
        slot of the step holds any."""
        if not self.has_experts():
            return None
        stacks = self.expert_slots.layers[layer]
        row_slots = self.token_slots(x.shape[0]).repeat_interleave(top_k)     # [num_tokens * k]
        return ExpertLora(row_slots, stacks.gate_up_a, stacks.gate_up_b, stacks.down_a, stacks.down_b,
                          self.expert_slots.num_slots, self.expert_slots.ranks[layer])

    def add_router(self, layer: int, x: torch.Tensor, logits: torch.Tensor) -> None:
        """The router's LoRA (module 16) added into its logits [num_tokens, experts]."""
        if self.has_experts():
            stacks = self.expert_slots.layers[layer]
            self.ops.slot_lora(x, stacks.router_a, stacks.router_b, self.token_slots(x.shape[0]), logits)

    def add_shared_gate(self, layer: int, x: torch.Tensor, gate: torch.Tensor) -> None:
        """The shared expert gate's LoRA (module 17) added into its logit [num_tokens, 1]."""
        if self.has_experts():
            stacks = self.expert_slots.layers[layer]
            self.ops.slot_lora(x, stacks.shared_gate_a, stacks.shared_gate_b, self.token_slots(x.shape[0]), gate)


class CpuLoraExecutor(LoraExecutor):
    """A step's LoRA by the compiled CPU kernels: a projection's bands in one call (kernels/cpu_ext.lora_apply)."""

    def linear(self, x: torch.Tensor, weight, bias: torch.Tensor | None, layer: int, name: str) -> torch.Tensor:
        """Semantics: LoraExecutor.linear. Over fp32 panels one compiled call, whose GEMM pulls the adapter rows a
        decode step's LoRA reads into the cache as it computes."""
        proj = self.projections[layer][name]
        if not isinstance(weight, QUANTIZED_WEIGHTS) and weight.dim() == 3:
            return cpu_ext.linear_lora(x, weight, bias, proj, self.segments)
        out = self.ops.linear(x, weight, bias)
        self.apply(x, proj, out)
        return out

    def apply(self, x: torch.Tensor, proj, out: torch.Tensor) -> None:
        cpu_ext.lora_apply(x, proj, self.segments, out)


class TritonLoraExecutor(LoraExecutor):
    """A step's LoRA by the Triton kernels: one shrink and one expand launch a projection for every band and slot,
    over the step's work list (segments.work). Its launches are planned at its first call for every projection
    kind the step runs (every layer's projection of a kind shares its shapes and strides: layer 0's), with the
    intermediates they share sized once (every projection and layer runs after the last, on one stream or,
    overlapping, on the side stream between a fork and a join): h in x's dtype, the split partials, the per-item
    counters (zero between launches) and, where the step overlaps LoRA with the base GEMMs, the fp32 delta. A call
    then does nothing in Python beyond its launches. split_k: the shrink's input split so (tests; else planned)."""

    def __init__(self, ops, segments: LoraSegments, projections: list[dict], experts=None,
                 split_k: int | None = None):
        super().__init__(ops, segments, projections, experts)
        assert segments.work is not None, "segments without a work list: not the Triton family's"
        self.split_k = split_k
        self.num_tokens, self.dtype, self.device = 0, None, None   # x's, at the first call
        self.counters: torch.Tensor | None = None
        self.kinds: dict[tuple, tuple] = {}                    # key -> (launch, a projection of the kind)
        self.prepared: dict[tuple, Prepared] = {}

    def linear(self, x: torch.Tensor, weight, bias: torch.Tensor | None, layer: int, name: str) -> torch.Tensor:
        """Semantics: LoraExecutor.linear. Where the step overlaps LoRA (segments.overlap: a CUDA graph's steps), the
        shrink and the expand run on a side stream beside the base GEMM, forked once x is ready, into the step's
        fp32 delta; lora_merge adds it after the join (the same bits as in place). On CPU the same launches run in
        turn."""
        proj = self.projections[layer][name]
        p = self.prepare(x, proj)
        if not self.segments.overlap:
            out = self.ops.linear(x, weight, bias)
            lora_expand(lora_shrink(x, proj, p), proj, p, out)
            return out
        out = self._beside(x, weight, bias, proj, p)
        lora_merge(proj, p, out)
        return out

    def linear_deferred(self, x: torch.Tensor, weight, bias: torch.Tensor | None, layer: int,
                        name: str) -> tuple[torch.Tensor, LoraDelta | None]:
        """Semantics: out = linear(x, weight, bias); return out, LoraDelta(lora_expand's product, ...): the LoRA left
        for the op that reads out next (add_rms_norm, silu_and_mul, rotary_and_cache) where the step folds
        (segments.token_slots: graph steps with LoRA beside the GEMMs); else self.linear(...), None."""
        if not self.segments.overlap or self.segments.token_slots is None:
            return self.linear(x, weight, bias, layer, name), None
        proj = self.projections[layer][name]
        p = self.prepare(x, proj)
        out = self._beside(x, weight, bias, proj, p)
        return out, LoraDelta(p.delta, proj.m, self.segments.token_slots)

    def apply(self, x: torch.Tensor, proj, out: torch.Tensor) -> None:
        """Semantics: LoraExecutor.apply, in two launches for all the projection's bands (shrink, expand)."""
        p = self.prepare(x, proj)
        lora_expand(lora_shrink(x, proj, p), proj, p, out)

    def _beside(self, x: torch.Tensor, weight, bias: torch.Tensor | None, proj, p: Prepared) -> torch.Tensor:
        """The base GEMM, and the shrink and expand into the step's delta on the side stream (joined after)."""
        side = side_stream(x.device)
        if side is not None:
            side.wait_stream(torch.cuda.current_stream(x.device))
        with torch.cuda.stream(side) if side is not None else nullcontext():
            lora_expand(lora_shrink(x, proj, p), proj, p, None)
        out = self.ops.linear(x, weight, bias)
        if side is not None:
            torch.cuda.current_stream(x.device).wait_stream(side)
        return out

    @staticmethod
    def kind(proj) -> tuple:
        """Projections of a kind share their shapes and strides, and so their launches."""
        return proj.a.shape[2], proj.b.shape[1], proj.num_bands

    def prepare(self, x: torch.Tensor, proj) -> Prepared:
        """proj's launches in this step (x: its input, [num_tokens, in_dim]); the first call plans every kind the
        step runs, a kind first seen later is planned then (the scratch sized again)."""
        prepared = self.prepared.get(self.kind(proj))
        if prepared is None:
            if self.counters is None:
                self.num_tokens, self.dtype, self.device = x.shape[0], x.dtype, x.device
                self.counters = torch.zeros(self.segments.work.shape[0], dtype=torch.int32, device=x.device)
            for other in [*self.projections[0].values(), proj]:
                self._plan(other)
            self._allocate()
            prepared = self.prepared[self.kind(proj)]
        return prepared

    def relaunched(self, proj, **changes) -> Prepared:
        """proj's launches (prepared already) with their configuration changed (LoraLaunch fields: a sweep's, a
        test's), over the same intermediates; `use` puts them in place."""
        p = self.prepared[self.kind(proj)]
        return prepare_launch(replace(p.launch, **changes), proj, p.work, p.counters, p.h, p.partials, p.delta)

    def use(self, proj, prepared: Prepared) -> None:
        """What the launches of proj's kind run from now on."""
        self.prepared[self.kind(proj)] = prepared

    def _plan(self, proj) -> None:
        key = self.kind(proj)
        if key not in self.kinds:
            launch = plan_launch(self.num_tokens, self.segments.work.shape[0], key[0], proj.widths, proj.max_rank,
                                 self.segments.block_m, self.split_k, self.dtype.itemsize)
            self.kinds[key] = (launch, proj)

    def _allocate(self) -> None:
        caps = {key: proj.num_bands * proj.max_rank for key, (_, proj) in self.kinds.items()}
        h = torch.empty(self.num_tokens, max(caps.values()), dtype=self.dtype, device=self.device)
        partials = torch.empty(max(launch.split_k * self.num_tokens * caps[key]
                                   for key, (launch, _) in self.kinds.items()), dtype=torch.float32,
                               device=self.device)
        delta = torch.empty(self.num_tokens * max(key[1] for key in self.kinds), dtype=torch.float32,
                            device=self.device) if self.segments.overlap else None
        for key, (launch, proj) in self.kinds.items():
            cap = caps[key]
            h_view = h[:, :cap]
            part_view = partials[:launch.split_k * self.num_tokens * cap].view(launch.split_k, self.num_tokens, cap)
            delta_view = None if delta is None else delta[:self.num_tokens * key[1]].view(self.num_tokens, key[1])
            self.prepared[key] = prepare_launch(launch, proj, self.segments.work, self.counters, h_view, part_view,
                                                delta_view)


_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def side_stream(device: torch.device) -> "torch.cuda.Stream | None":
    """The stream LoRA runs on beside the GEMMs, one per CUDA device (None on CPU)."""
    if device.type != "cuda":
        return None
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return _SIDE_STREAMS[device]
