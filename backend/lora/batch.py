"""A step's adapters as the model's projections take them: the device slots and the step's segments."""
import torch

from backend.lora.slots import DeviceSlots
from kernels.lora_segments import LoraSegments


class LoraBatch:
    """What `linear` calls for each projection with adapters in the step: its GEMM plus expand(shrink(x)) for every
    module band of it, from the device slots (ops.linear_lora)."""

    def __init__(self, slots: DeviceSlots, segments: LoraSegments, ops):
        self.slots = slots
        self.segments = segments
        self.ops = ops
        segments.projections = list(slots.projections[0].values())          # what the step will run

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, layer: int,
               proj: str) -> torch.Tensor:
        """x @ weight^T (+ bias) + expand(shrink(x)) of every band of the projection."""
        return self.ops.linear_lora(x, weight, bias, self.slots.projections[layer][proj], self.segments)

    def linear_deferred(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, layer: int,
                        proj: str) -> tuple[torch.Tensor, object | None]:
        """(x @ weight^T (+ bias), the LoRA delta the next op adds) where the step folds, else (linear(...), None)."""
        return self.ops.linear_lora_deferred(x, weight, bias, self.slots.projections[layer][proj], self.segments)
