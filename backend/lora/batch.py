"""A step's adapters as the model's projections take them: the device slots and the step's segments."""
import torch

from backend.lora.slots import DeviceSlots
from kernels.lora_segments import LoraSegments
from kernels.metadata import ExpertLora


class LoraBatch:
    """What the model's projections call in a step with adapters (LlamaModel.project): the kernel backend's GEMM
    plus expand(shrink(x)) for every module band of the projection, from the device slots, in one call
    (ops.linear_lora: kernels/lora_overlap.py on the Triton path, whose shrink and expand launch the kernels)."""

    def __init__(self, slots: DeviceSlots, segments: LoraSegments, ops):
        self.slots = slots
        self.segments = segments
        self.ops = ops
        segments.projections = list(slots.projections[0].values())          # what the step will run
        self._token_slots: torch.Tensor | None = None

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, layer: int,
               proj: str) -> torch.Tensor:
        """x @ weight^T (+ bias) + expand(shrink(x)) of every band of the projection."""
        return self.ops.linear_lora(x, weight, bias, self.slots.projections[layer][proj], self.segments)

    def linear_deferred(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, layer: int,
                        proj: str) -> tuple[torch.Tensor, object | None]:
        """(x @ weight^T (+ bias), the LoRA delta the next op adds) where the step folds, else (linear(...), None)."""
        return self.ops.linear_lora_deferred(x, weight, bias, self.slots.projections[layer][proj], self.segments)

    def token_slots(self, num_tokens: int) -> torch.Tensor:
        """[num_tokens] int32 on the device: each token's slot, -1 for none (from the segments, no host sync)."""
        if self._token_slots is None:
            s = self.segments
            self._token_slots = torch.repeat_interleave(s.slots, s.starts[1:] - s.starts[:-1], output_size=num_tokens)
        return self._token_slots

    def has_experts(self) -> bool:
        """A slot of the step holds expert modules (13-17). A graph's step, whose slots the host does not know when
        it is recorded, runs them whatever its slots hold."""
        experts, s = self.slots.experts, self.segments
        if experts is None:
            return False
        recorded = s.starts_list[-1] == 0
        return recorded or any(slot >= 0 and experts.loaded[slot] for slot in s.slots_list)

    def experts(self, layer: int, x: torch.Tensor, top_k: int) -> ExpertLora | None:
        """Layer `layer`'s expert LoRA for the step's (token, expert) rows (x: the layer's input), or None where no
        slot of the step holds any."""
        if not self.has_experts():
            return None
        stacks = self.slots.experts.layers[layer]
        row_slots = self.token_slots(x.shape[0]).repeat_interleave(top_k)     # [num_tokens * k]
        return ExpertLora(row_slots, stacks.gate_up_a, stacks.gate_up_b, stacks.down_a, stacks.down_b,
                          self.slots.num_slots, self.slots.experts.ranks[layer])

    def add_router(self, layer: int, x: torch.Tensor, logits: torch.Tensor) -> None:
        """The router's LoRA (module 16) added into its logits [num_tokens, experts]."""
        if self.has_experts():
            stacks = self.slots.experts.layers[layer]
            self.ops.slot_lora(x, stacks.router_a, stacks.router_b, self.token_slots(x.shape[0]), logits)

    def add_shared_gate(self, layer: int, x: torch.Tensor, gate: torch.Tensor) -> None:
        """The shared expert gate's LoRA (module 17) added into its logit [num_tokens, 1]."""
        if self.has_experts():
            stacks = self.slots.experts.layers[layer]
            self.ops.slot_lora(x, stacks.shared_gate_a, stacks.shared_gate_b, self.token_slots(x.shape[0]), gate)
