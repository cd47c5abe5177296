"""An adapter's share on one tensor-parallel rank, as TensorRT-LLM splits LoRA under tensor parallelism.

A column-parallel projection (q, k, v, gate, up: its output split across ranks) keeps the whole A [rank, in] on
every rank and splits B [out, rank] by output rows. A row-parallel one (o, down: its input split) splits A by input
columns and keeps the whole B. The row-parallel shrink x_r A_r^T is then a partial sum, but the expand is linear, so
each rank expands its partial shrink with the whole B and the layer's own all-reduce sums the LoRA delta with the
base output: sum_r (x_r A_r^T) B^T = (x A^T) B^T, no reduction of its own. A mixture's experts split alike, each
expert on its own (gate and up column-parallel, down row-parallel); the router's and a shared expert gate's LoRA
stay whole on every rank, as their weights do.
"""
import torch

from backend.lora.format import LoraAdapter, packed
from backend.model.checkpoint import ModelConfig

COLUMN_MODULES = (0, 1, 2, 3, 5, 7)           # attn_qkv, attn_q, attn_k, attn_v, mlp_h_to_4h (gate), mlp_gate (up)
ROW_MODULES = (4, 6, 14)                      # attn_dense (o), mlp_4h_to_h (down), moe_4h_to_h (experts' down)
WHOLE_MODULES = (16, 17)                      # moe_router, mlp_router (a shared expert's gate)


def _part(t: torch.Tensor, dim: int, parts: int, index: int) -> torch.Tensor:
    size = t.shape[dim] // parts
    return t.narrow(dim, index * size, size)


def shard_module(module_id: int, a: torch.Tensor, b: torch.Tensor, cfg: ModelConfig, tp_size: int,
                 rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(A, B) of one module on one rank; cfg is the whole model's. k and v split by KV heads, as the base weights
    (ModelConfig.kv_head_part: a head on several ranks where there are fewer KV heads than ranks)."""
    kv_parts, kv_index, _ = cfg.kv_head_part(tp_size, rank)
    if module_id in ROW_MODULES:
        return _part(a, 1, tp_size, rank), b
    if module_id in WHOLE_MODULES:
        return a, b
    if module_id in (13, 15):                  # B [experts * inter, rank]: each expert's rows split
        num = cfg.num_experts
        return a, _part(b.view(num, -1, b.shape[1]), 1, tp_size, rank).reshape(-1, b.shape[1])
    if module_id == 0:                         # fused qkv: each of q, k, v split on its own
        q, k, v = b.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=0)
        return a, torch.cat([_part(q, 0, tp_size, rank), _part(k, 0, kv_parts, kv_index),
                             _part(v, 0, kv_parts, kv_index)])
    if module_id in (2, 3):
        return a, _part(b, 0, kv_parts, kv_index)
    return a, _part(b, 0, tp_size, rank)


def shard_magnitude(module_id: int, m: torch.Tensor, cfg: ModelConfig, tp_size: int, rank: int) -> torch.Tensor:
    """A DoRA magnitude's share: split with B's rows for a column-parallel module; whole for a row-parallel one, whose
    partial outputs the rank scales by the whole vector before the all-reduce sums them (the scale is per output
    feature, the sum linear)."""
    return shard_module(module_id, m[None], m[:, None], cfg, tp_size, rank)[1][:, 0]


def shard_adapter(adapter: LoraAdapter, cfg: ModelConfig, tp_size: int, rank: int) -> LoraAdapter:
    """The adapter's share on `rank` of `tp_size` (the adapter itself at tp_size 1), packed in a buffer of its own
    (backend/lora/format.py: the layout the device tier copies fastest, the bytes sent to the rank's worker)."""
    if tp_size == 1:
        return adapter
    return packed({(layer, module_id): shard_module(module_id, a, b, cfg, tp_size, rank)
                   for (layer, module_id), (a, b) in adapter.weights.items()},
                  magnitudes={(layer, module_id): shard_magnitude(module_id, m, cfg, tp_size, rank)
                              for (layer, module_id), m in adapter.magnitudes.items()})
