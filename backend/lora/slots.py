"""The device tier's memory: every slot's adapter packed per layer and projection, ready for shrink/expand.

Per layer and projection (qkv, o, gate_up, down) a slot holds
    A [cap, in_dim]: the A of each module in the projection, stacked along the rank
    B [out_dim, cap]: each module's B in its output columns and its own rank columns (zeros elsewhere)
so one shrink (x @ A[:R]^T) and one expand (+= h @ B[:, :R]^T) serve the whole projection, where R is the
sum of that slot's ranks there: mixed ranks cost what they are, not the max rank. Both are stored with the rank
as the outer dimension (A^T [in_dim, cap], B^T [cap, out_dim]) and exposed transposed, so the torch path's
batched matmuls read plain row-major operands.
"""
import torch

from backend.lora.format import PROJ_OF_MODULE, LoraAdapter, module_columns
from backend.model.config import ModelConfig

PROJS = ("qkv", "o", "gate_up", "down")
RANK_CAP = {"qkv": 3, "o": 1, "gate_up": 2, "down": 1}    # modules a projection may stack, times max rank


def proj_shape(cfg: ModelConfig, proj: str) -> tuple[int, int]:
    h, q, kv, inter = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    return {"qkv": (h, q + 2 * kv), "o": (q, h), "gate_up": (h, 2 * inter), "down": (inter, h)}[proj]


class DeviceSlots:
    def __init__(self, cfg: ModelConfig, num_slots: int, max_rank: int, dtype: torch.dtype, device="cpu"):
        self.cfg = cfg
        self.num_slots = num_slots
        self.a: list[dict[str, torch.Tensor]] = []
        self.b: list[dict[str, torch.Tensor]] = []
        for _ in range(cfg.num_layers):
            self.a.append({})
            self.b.append({})
            for proj in PROJS:
                in_dim, out_dim = proj_shape(cfg, proj)
                cap = RANK_CAP[proj] * max_rank
                a_t = torch.zeros(num_slots, in_dim, cap, dtype=dtype, device=device)
                b_t = torch.zeros(num_slots, cap, out_dim, dtype=dtype, device=device)
                self.a[-1][proj] = a_t.transpose(1, 2)          # [num_slots, cap, in_dim]
                self.b[-1][proj] = b_t.transpose(1, 2)          # [num_slots, out_dim, cap]
        self.ranks = torch.zeros(cfg.num_layers, len(PROJS), num_slots, dtype=torch.int32)   # [layer, proj, slot]
        self.ranks_list: list[list[list[int]]] = self.ranks.tolist()

    @property
    def num_bytes_per_slot(self) -> int:
        return sum(t[0].nbytes for layer in self.a + self.b for t in layer.values())

    def load(self, slot: int, adapter: LoraAdapter) -> None:
        """Copy an adapter into a slot, replacing whatever was there."""
        offsets = torch.zeros(self.cfg.num_layers, len(PROJS), dtype=torch.int64)
        for layer in range(self.cfg.num_layers):
            for proj in PROJS:
                self.a[layer][proj][slot].zero_()
                self.b[layer][proj][slot].zero_()
        for (layer, module_id), (a, b) in sorted(adapter.weights.items()):
            proj = PROJ_OF_MODULE[module_id]
            p = PROJS.index(proj)
            start = int(offsets[layer, p])
            rank = a.shape[0]
            col_start, col_end = module_columns(self.cfg, module_id)
            self.a[layer][proj][slot, start:start + rank] = a
            self.b[layer][proj][slot, col_start:col_end, start:start + rank] = b
            offsets[layer, p] += rank
        self.ranks[:, :, slot] = offsets.to(torch.int32)
        for layer in range(self.cfg.num_layers):
            for p in range(len(PROJS)):
                self.ranks_list[layer][p][slot] = int(offsets[layer, p])
