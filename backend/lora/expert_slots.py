"""The device tier's memory for a mixture's adapters (TensorRT-LLM modules 13-17): every slot's experts, router and
shared expert gate, per mixture layer, stacked so that one grouped GEMM reads any (slot, expert) pair's matrices
(kernels/moe.py; their layout: kernels/metadata.ExpertLora).

Per mixture layer, for num_slots slots of max_rank rank rows each (group g = slot * experts + expert):
    gate_up_a [groups, 2 max_rank, hidden]   gate's A (13) in rows [0, r), up's A (15) in [max_rank, max_rank + r)
    gate_up_b [2, groups, inter, max_rank]   gate's B, then up's (each contiguous: a batched expand reads it whole)
    down_a [groups, max_rank, inter], down_b [groups, hidden, max_rank]                      (14)
    router_a [slots, max_rank, hidden], router_b [slots, experts, max_rank]                  (16)
    shared_gate_a [slots, max_rank, hidden], shared_gate_b [slots, 1, max_rank]              (17, Qwen2-MoE)
Zero wherever no adapter row lies, so a slot's unused rank rows, experts and modules add nothing. A slot is cleared
whole before an adapter with expert modules replaces one that had them.
"""
from dataclasses import dataclass

import torch

from backend.lora.format import EXPERT_MODULE_NAMES, LoraAdapter
from backend.model.checkpoint import ModelConfig


@dataclass(slots=True)
class ExpertLayer:
    """One mixture layer's stacks (the module docstring's layout); a Qwen2-MoE's shared gate ones, or None."""
    gate_up_a: torch.Tensor
    gate_up_b: torch.Tensor
    down_a: torch.Tensor
    down_b: torch.Tensor
    router_a: torch.Tensor
    router_b: torch.Tensor
    shared_gate_a: torch.Tensor | None
    shared_gate_b: torch.Tensor | None

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.gate_up_a, *self.gate_up_b, self.down_a, self.down_b, self.router_a, self.router_b,
                            self.shared_gate_a, self.shared_gate_b) if t is not None]


class ExpertSlots:
    def __init__(self, cfg: ModelConfig, num_slots: int, max_rank: int, dtype: torch.dtype, device):
        """cfg: this rank's share (each expert's intermediate dim split under tensor parallelism)."""
        self.cfg, self.num_slots, self.max_rank = cfg, num_slots, max_rank
        h, inter, num, r = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, max_rank
        groups = num_slots * num

        def zeros(*shape):
            return torch.zeros(*shape, dtype=dtype, device=device)

        self.layers = {layer: ExpertLayer(zeros(groups, 2 * r, h), zeros(2, groups, inter, r), zeros(groups, r, inter),
                                          zeros(groups, h, r), zeros(num_slots, r, h), zeros(num_slots, num, r),
                                          zeros(num_slots, r, h) if cfg.shared_expert else None,
                                          zeros(num_slots, 1, r) if cfg.shared_expert else None)
                       for layer in range(cfg.num_layers) if cfg.is_moe(layer)}
        self.loaded = [False] * num_slots             # the slot holds expert modules (host)
        self.ranks = {layer: torch.zeros(num_slots, dtype=torch.long) for layer in self.layers}  # (host) a slot's
                                                                                   # largest expert rank, per layer

    @property
    def num_bytes_per_slot(self) -> int:
        return sum(t.nbytes for layer in self.layers.values() for t in layer.tensors()) // self.num_slots

    def load(self, slot: int, adapter: LoraAdapter) -> None:
        """The adapter's expert modules into the slot (the caller orders the copies: DeviceSlots.load)."""
        if self.loaded[slot]:
            for layer in self.layers.values():
                for t in layer.tensors():
                    self._of_slot(t, slot).zero_()
        num = self.cfg.num_experts
        modules = [(key, pair) for key, pair in adapter.weights.items() if key[1] in EXPERT_MODULE_NAMES]
        for layer, ranks in self.ranks.items():
            ranks[slot] = max((a.shape[0] // num for (at, module), (a, _) in modules
                               if at == layer and module in (13, 14, 15)), default=0)
        for (layer, module), (a, b) in modules:
            stacks = self.layers[layer]
            if module in (16, 17):
                r = a.shape[0]
                dst_a, dst_b = (stacks.router_a, stacks.router_b) if module == 16 else (stacks.shared_gate_a,
                                                                                       stacks.shared_gate_b)
                dst_a[slot, :r].copy_(a, non_blocking=True)
                dst_b[slot, :, :r].copy_(b, non_blocking=True)
                continue
            r = a.shape[0] // num
            a, b = a.view(num, r, a.shape[1]), b.view(num, -1, r)          # [experts, r, in], [experts, out, r]
            if module == 14:
                self._of_slot(stacks.down_a, slot)[:, :r].copy_(a, non_blocking=True)
                self._of_slot(stacks.down_b, slot)[:, :, :r].copy_(b, non_blocking=True)
            else:
                part = 0 if module == 13 else 1                            # gate, up
                rows = slice(part * self.max_rank, part * self.max_rank + r)
                self._of_slot(stacks.gate_up_a, slot)[:, rows].copy_(a, non_blocking=True)
                self._of_slot(stacks.gate_up_b[part], slot)[:, :, :r].copy_(b, non_blocking=True)
        self.loaded[slot] = bool(modules)

    def _of_slot(self, t: torch.Tensor, slot: int) -> torch.Tensor:
        """A stack's rows of one slot: its experts' groups, or its own row."""
        per_slot = t.shape[0] // self.num_slots
        return t[slot * per_slot:(slot + 1) * per_slot]
