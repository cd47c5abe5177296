"""A step's LoRA metadata: token segments grouped by adapter slot, built once (kernels/lora/family.py) and read by
the step's LoRA executor (kernels/lora/executor.py)."""
from dataclasses import dataclass

import torch

from kernels.lora.launch import work_items


@dataclass(slots=True)
class PaddedLayout:
    """Tokens [token_start:] (all with an adapter, one segment per slot, slots ascending) laid out as a zero-padded
    [num_slots, max_len] grid over slots slot_start.., so that one batched matmul per module band serves them all."""
    token_start: int
    slot_start: int
    num_slots: int
    max_len: int
    rows: torch.Tensor                        # [num_tokens - token_start] int32: each token's row in the grid
    slot_ids: list[int]                       # the slots that have tokens


PAD_WASTE = 2.0                               # use the padded grid while it holds at most this many rows per token
GRID_MAX_LEN = 32                             # and while segments are this short: longer ones run well one by one


@dataclass(slots=True)
class LoraSegments:
    """Contiguous token runs that share an adapter slot (slot -1: base only, skipped by the kernels)."""
    starts: torch.Tensor                      # [num_segments + 1] int32: segment s is tokens [starts[s], starts[s+1])
    slots: torch.Tensor                       # [num_segments] int32
    starts_list: list[int]
    slots_list: list[int]
    max_len: int                              # longest segment, for kernel grids
    padded: PaddedLayout | None = None        # the batched-matmul grid, where it pays (torch path)
    work: torch.Tensor | None = None          # [num_items, 3] int32: the Triton kernels' work list
    block_m: int = 0                          # its rows per item
    overlap: bool = False                     # LoRA beside the base GEMMs, on a side stream (TritonLoraExecutor)
    token_slots: torch.Tensor | None = None   # [num_tokens] int32, -1: none; where the next op may add a projection's
                                              # LoRA product (kernels/lora/executor.LoraDelta: graph steps)

    @classmethod
    def from_token_slots(cls, token_slots: list[int], block_m: int = 0,
                         num_items: int | None = None) -> "LoraSegments":
        """block_m: the Triton kernels' work list, of num_items items (default: as many as the step has), instead of
        the padded grid."""
        starts, slots = [0], []
        for i, slot in enumerate(token_slots):
            if i == 0 or slot != token_slots[i - 1]:
                if i:
                    starts.append(i)
                slots.append(slot)
        starts.append(len(token_slots))
        max_len = max((b - a for a, b in zip(starts, starts[1:])), default=0)
        work = work_items(starts, slots, block_m, num_items) if block_m else None
        return cls(torch.tensor(starts, dtype=torch.int32), torch.tensor(slots, dtype=torch.int32), starts, slots,
                   max_len, None if block_m else padded_layout(starts, slots), work, block_m)

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        """The host tensors, for the step's one upload."""
        rows = {} if self.padded is None else {"lora_rows": self.padded.rows}
        work = {} if self.work is None else {"lora_work": self.work}
        return {"lora_starts": self.starts, "lora_slots": self.slots} | rows | work

    def use(self, t: dict[str, torch.Tensor]) -> None:
        """Point at the device copies of `tensors`."""
        self.starts, self.slots = t["lora_starts"], t["lora_slots"]
        if self.padded is not None:
            self.padded.rows = t["lora_rows"]
        if self.work is not None:
            self.work = t["lora_work"]


def padded_layout(starts: list[int], slots: list[int]) -> PaddedLayout | None:
    """The grid for batched matmuls, when the segments allow one (adapter segments last, one per slot, in slot
    order: the runner sorts its batch that way), its segments are short (decode steps, where one matmul per
    segment is all call overhead) and it wastes at most PAD_WASTE rows per token."""
    first = next((s for s, slot in enumerate(slots) if slot >= 0), len(slots))
    lora_slots = slots[first:]
    if len(lora_slots) < 2 or any(b <= a for a, b in zip(lora_slots, lora_slots[1:])):
        return None
    lengths = [starts[s + 1] - starts[s] for s in range(first, len(slots))]
    num_slots, max_len = lora_slots[-1] - lora_slots[0] + 1, max(lengths)
    if max_len > GRID_MAX_LEN or num_slots * max_len > PAD_WASTE * sum(lengths):
        return None
    rows = torch.cat([(slot - lora_slots[0]) * max_len + torch.arange(n, dtype=torch.int32)
                      for slot, n in zip(lora_slots, lengths)])
    return PaddedLayout(starts[first], lora_slots[0], num_slots, max_len, rows, lora_slots)
