"""Per-step LoRA metadata: token segments grouped by device slot, built once and used by every layer."""
from dataclasses import dataclass

import torch

from backend.lora.slots import PROJS, DeviceSlots


@dataclass(slots=True)
class LoraSegments:
    """Contiguous token runs that share an adapter slot (slot -1: base only, skipped by the kernels)."""
    starts: torch.Tensor                      # [num_segments + 1] int32: segment s is tokens [starts[s], starts[s+1])
    slots: torch.Tensor                       # [num_segments] int32
    starts_list: list[int]
    slots_list: list[int]
    max_len: int                              # longest segment, for kernel grids

    @classmethod
    def from_token_slots(cls, token_slots: list[int]) -> "LoraSegments":
        starts, slots = [0], []
        for i, slot in enumerate(token_slots):
            if i == 0 or slot != token_slots[i - 1]:
                if i:
                    starts.append(i)
                slots.append(slot)
        starts.append(len(token_slots))
        max_len = max((b - a for a, b in zip(starts, starts[1:])), default=0)
        return cls(torch.tensor(starts, dtype=torch.int32), torch.tensor(slots, dtype=torch.int32), starts, slots,
                   max_len)


class LoraBatch:
    """What `linear` calls for each projection: out += expand(shrink(x)) per segment, from the device slots."""

    def __init__(self, slots: DeviceSlots, segments: LoraSegments, ops):
        self.slots = slots
        self.segments = segments
        self.ops = ops

    def apply(self, x: torch.Tensor, out: torch.Tensor, layer: int, proj: str) -> None:
        p = PROJS.index(proj)
        ranks, ranks_list = self.slots.ranks[layer, p], self.slots.ranks_list[layer][p]
        h = self.ops.lora_shrink(x, self.slots.a[layer][proj], self.segments, ranks, ranks_list)
        self.ops.lora_expand(h, self.slots.b[layer][proj], self.segments, ranks, ranks_list, out)
