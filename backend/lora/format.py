"""TensorRT-LLM's LoRA tensors -> per-layer, per-module (A, B) pairs (and DoRA magnitudes), validated.

lora_config rows are [module_id, layer_idx, rank] or, as TensorRT-LLM's converter writes them today,
[module_id, layer_idx, rank, is_dora]; the matching lora_weights row holds A [rank, in_dim] flattened row-major,
then B [out_dim, rank] flattened row-major, then for a DoRA row the magnitude [out_dim], normalized as
TensorRT-LLM's normalize_weights.py does (m / ||W + s·B·A|| per output row), then zero padding. The scale is
already folded into B. A DoRA module's whole output (base + LoRA) is scaled by its magnitude, per output feature.
A mixture of experts' modules (13-15: each expert's gate, down and up; 16: the router; 17: a shared expert's gate)
hold every expert's A [experts, rank, in_dim] then every expert's B [experts, out_dim, rank] in one row, rank per
expert, as TensorRT-LLM's load_from_hf writes them.
"""
import math
from dataclasses import dataclass, field

import numpy as np
import torch

from backend.core.request import RequestError
from backend.model.checkpoint import ModelConfig

MODULE_NAMES = {0: "attn_qkv", 1: "attn_q", 2: "attn_k", 3: "attn_v", 4: "attn_dense",
                5: "mlp_h_to_4h", 6: "mlp_4h_to_h", 7: "mlp_gate"}
EXPERT_MODULE_NAMES = {13: "moe_h_to_4h", 14: "moe_4h_to_h", 15: "moe_gate", 16: "moe_router", 17: "mlp_router"}
UNSUPPORTED_MODULES = {8: "cross_attn_qkv", 9: "cross_attn_q", 10: "cross_attn_k", 11: "cross_attn_v",
                       12: "cross_attn_dense"}
PROJ_OF_MODULE = {0: "qkv", 1: "qkv", 2: "qkv", 3: "qkv", 4: "o", 5: "gate_up", 6: "down", 7: "gate_up"}
FUSED_GATE_UP = 5                             # mlp_h_to_4h: gate and up at once where the checkpoint fuses them


def expert_module_shape(cfg: ModelConfig, module_id: int) -> tuple[int, int, int]:
    """(experts, in_dim, out_dim) of an expert module (TensorRT-LLM's ids): each expert's gate (13, moe_h_to_4h),
    down (14) or up (15, moe_gate), the router (16: hidden -> experts) and the shared expert's gate (17: hidden -> 1).
    A lora_weights row of one holds A [experts, rank, in_dim] then B [experts, out_dim, rank]."""
    h, inter, num = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
    return {13: (num, h, inter), 14: (num, inter, h), 15: (num, h, inter), 16: (1, h, num), 17: (1, h, 1)}[module_id]


def module_refusal(cfg: ModelConfig, module_id: int, layer: int) -> str | None:
    """Why a module may not adapt this layer, or None."""
    name = MODULE_NAMES.get(module_id) or EXPERT_MODULE_NAMES.get(module_id)
    what = f"module {module_id} ({name}): layer {layer} of {cfg.architecture}"
    if module_id in (5, 6, 7) and not cfg.has_dense_mlp(layer):
        return f"{what} is a mixture of experts with no dense MLP or shared expert (its experts: modules 13-16)"
    if module_id in EXPERT_MODULE_NAMES:
        if not cfg.num_experts:
            return f"module {module_id} ({name}): {cfg.architecture} is not a mixture of experts"
        if not cfg.is_moe(layer):
            return f"{what} is a dense MLP, no mixture of experts (modules 5-7 adapt it)"
        if module_id == 17 and not cfg.shared_expert:
            return f"{what} has no shared expert, whose gate module 17 adapts"
    return None


def module_shape(cfg: ModelConfig, module_id: int) -> tuple[int, int]:
    """(in_dim, out_dim) of a module's base projection."""
    h, q, kv, inter = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    return {0: (h, q + 2 * kv), 1: (h, q), 2: (h, kv), 3: (h, kv), 4: (q, h),
            5: (h, inter), 6: (inter, h), 7: (h, inter)}[module_id]


def row_shape(cfg: ModelConfig, module_id: int) -> tuple[int, int]:
    """(in_dim, out_dim) of a lora_weights row's module: its base projection, but for a family whose checkpoint fuses
    gate and up (ModelConfig.fused_projections), whose module 5 (mlp_h_to_4h) is both: its rows are split into
    gate (5) and up (7) as they are parsed (`_row_views`)."""
    if module_id == FUSED_GATE_UP and cfg.fused_projections:
        return cfg.hidden_size, 2 * cfg.intermediate_size
    return module_shape(cfg, module_id)


def module_columns(cfg: ModelConfig, module_id: int) -> tuple[int, int]:
    """The output columns [start, end) a module writes within its fused projection (qkv, gate_up)."""
    q, kv, inter = cfg.q_size, cfg.kv_size, cfg.intermediate_size
    start = {2: q, 3: q + kv, 7: inter}.get(module_id, 0)
    return start, start + module_shape(cfg, module_id)[1]


Key = tuple[int, int]                          # (layer, module_id)


@dataclass(slots=True)
class LoraAdapter:
    """One adapter, parsed: (layer, module_id) -> (A [rank, in_dim], B [out_dim, rank]) in the cache's dtype, and
    for its DoRA modules (layer, module_id) -> normalized magnitude [out_dim]; `buffer`, when set, is the one tensor
    they are views of, laid out as `packed_views` says."""
    weights: dict[Key, tuple[torch.Tensor, torch.Tensor]]
    buffer: torch.Tensor | None = None
    magnitudes: dict[Key, torch.Tensor] = field(default_factory=dict)

    @property
    def num_bytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values()) + sum(
            m.nbytes for m in self.magnitudes.values())

    @property
    def shapes(self) -> dict[Key, tuple[torch.Size, torch.Size]]:
        return _shapes(self.weights)

    def is_pinned(self) -> bool:
        return all(t.is_pinned() for pair in self.weights.values() for t in pair) and all(
            m.is_pinned() for m in self.magnitudes.values())

    def pinned(self, device: torch.device) -> "LoraAdapter":
        """The adapter in page-locked memory when it will be uploaded to a GPU (asynchronous copies need it): one
        pinned buffer (one page-locking call, not two per module) filled in one copy, made where the adapter is
        parsed, off the engine thread."""
        if device.type != "cuda" or self.is_pinned():
            return self
        with torch.cuda.device(device):       # not a context on GPU 0 when serving on cuda:N
            if self.buffer is None:
                return packed(self.weights, pin=True, magnitudes=self.magnitudes)
            buffer = torch.empty_like(self.buffer, pin_memory=True).copy_(self.buffer)
        views, magnitudes = packed_views(buffer, self.shapes, set(self.magnitudes))
        return LoraAdapter(views, buffer, magnitudes)

    def same_as(self, other: "LoraAdapter") -> bool:
        return self.weights.keys() == other.weights.keys() and all(
            torch.equal(a, other.weights[k][0]) and torch.equal(b, other.weights[k][1])
            for k, (a, b) in self.weights.items()) and self.magnitudes.keys() == other.magnitudes.keys() and all(
            torch.equal(m, other.magnitudes[k]) for k, m in self.magnitudes.items())

    def matches(self, weights: torch.Tensor, rows: list["Row"], cfg: ModelConfig) -> bool:
        """These checked lora_weights rows parse to this very adapter: a re-sent adapter needs no second parse.
        Reads only on a re-send, which costs less than hashing every upload would."""
        views = list(_row_views(weights, rows, cfg))
        return len(views) == len(self.weights) and all(
            key in self.weights and _equal(a, self.weights[key][0]) and _equal(b, self.weights[key][1])
            and (m is None) == (key not in self.magnitudes) and (m is None or _equal(m, self.magnitudes[key]))
            for key, a, b, m in views)


def packed_views(buffer: torch.Tensor, shapes: dict[Key, tuple], dora: set[Key] = frozenset()) -> tuple[
        dict[Key, tuple[torch.Tensor, torch.Tensor]], dict[Key, torch.Tensor]]:
    """An adapter's matrices as views of its one buffer, module by module: every layer's A (in layer order), then
    every layer's B, then the magnitudes of its DoRA layers. So a module's A (or B, or magnitude) over consecutive
    layers of equal rank is one contiguous block, which the device tier copies in one go (backend/lora/slots.py).
    -> (pairs, magnitudes)."""
    views: dict[Key, list[torch.Tensor]] = {}
    magnitudes: dict[Key, torch.Tensor] = {}
    offset = 0
    for module in sorted({module for _, module in shapes}):
        keys = sorted(key for key in shapes if key[1] == module)
        for i in (0, 1):
            for key in keys:
                numel = math.prod(shapes[key][i])
                views.setdefault(key, []).append(buffer[offset:offset + numel].view(shapes[key][i]))
                offset += numel
        for key in (key for key in keys if key in dora):
            numel = shapes[key][1][0]
            magnitudes[key] = buffer[offset:offset + numel]
            offset += numel
    assert offset == buffer.numel(), "the buffer holds exactly the adapter"
    return {key: tuple(pair) for key, pair in views.items()}, magnitudes


def packed(pairs: dict[Key, tuple[torch.Tensor, torch.Tensor]], dtype: torch.dtype | None = None,
           pin: bool = False, magnitudes: dict[Key, torch.Tensor] | None = None) -> LoraAdapter:
    """The pairs (and magnitudes) copied into one new buffer (`packed_views`' layout), in `dtype` (default: theirs),
    page-locked when asked."""
    magnitudes = magnitudes or {}
    dtype = dtype or next(iter(pairs.values()))[0].dtype
    numel = sum(a.numel() + b.numel() for a, b in pairs.values()) + sum(m.numel() for m in magnitudes.values())
    buffer = torch.empty(numel, dtype=dtype, pin_memory=pin)
    views, mag_views = packed_views(buffer, _shapes(pairs), set(magnitudes))
    for key, (a, b) in pairs.items():
        views[key][0].copy_(a)
        views[key][1].copy_(b)
    for key, m in magnitudes.items():
        mag_views[key].copy_(m)
    return LoraAdapter(views, buffer, mag_views)


def _shapes(pairs: dict[Key, tuple[torch.Tensor, torch.Tensor]]) -> dict[Key, tuple[torch.Size, torch.Size]]:
    return {key: (a.shape, b.shape) for key, (a, b) in pairs.items()}


def _as_tensor(name: str, value) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    value = np.asarray(value)
    if value.dtype == np.uint16:                  # bf16 bits, as numpy has no bfloat16
        return torch.from_numpy(value.astype(np.int16)).view(torch.bfloat16)
    if value.dtype not in (np.float16, np.float32, np.float64, np.int32, np.int64):
        raise RequestError(name, f"unsupported dtype {value.dtype}")
    return torch.from_numpy(np.ascontiguousarray(value))


def row_need(cfg: ModelConfig, module_id: int, rank: int, dora: bool = False) -> int:
    """Values a lora_weights row of this module needs: A and B (every expert's, for an expert module), and a DoRA
    magnitude."""
    if module_id in EXPERT_MODULE_NAMES:
        num, in_dim, out_dim = expert_module_shape(cfg, module_id)
        return num * rank * (in_dim + out_dim)
    in_dim, out_dim = row_shape(cfg, module_id)
    return rank * (in_dim + out_dim) + (out_dim if dora else 0)


def max_row_width(cfg: ModelConfig, max_rank: int) -> int:
    """The widest lora_weights row any valid config row needs: max_lora_rank x (in + out) of the widest module, and
    its DoRA magnitude (out); a mixture's expert modules (every expert's A and B) among them."""
    modules = list(MODULE_NAMES) + (list(EXPERT_MODULE_NAMES) if cfg.num_experts else [])
    return max(row_need(cfg, m, max_rank, m in MODULE_NAMES) for m in modules)


Row = tuple[int, int, int, int, bool]          # (module_id, layer, rank, values its weights row needs, is_dora)


def check_lora(weights, config, cfg: ModelConfig, dtype: torch.dtype, max_rank: int,
               max_adapter_bytes: int) -> tuple[torch.Tensor, torch.Tensor, list[Row]]:
    """TRT-LLM lora_weights [N, R] (or [1, N, R]) and lora_config [N, 3|4] (or [1, N, 3|4]) checked without reading a
    weight: shapes, dtypes, the config rows and the adapter's size. -> (weights, config, rows)."""
    weights, config = _as_tensor("lora_weights", weights), _as_tensor("lora_config", config)
    if weights.dim() == 3 and weights.shape[0] == 1:
        weights = weights[0]
    if config.dim() == 3 and config.shape[0] == 1:
        config = config[0]
    if weights.dim() != 2:
        raise RequestError("lora_weights",
                           f"must be [N, D*Hi + Ho*D] (or [1, N, ...]), got shape {list(weights.shape)}")
    if config.dim() != 2 or config.shape[1] not in (3, 4):
        raise RequestError("lora_config", f"must be [N, 3] or [N, 4] (or [1, N, 3|4]), got shape "
                                          f"{list(config.shape)}")
    if config.shape[0] == 0:
        raise RequestError("lora_config", "has no rows: an adapter needs at least one module")
    if weights.shape[0] != config.shape[0]:
        raise RequestError("lora_config", f"has {config.shape[0]} rows but lora_weights has {weights.shape[0]}")
    width = max_row_width(cfg, max_rank)
    if weights.shape[1] > width:
        raise RequestError("lora_weights", f"rows of {weights.shape[1]} values exceed the widest module's "
                                           f"max_lora_rank {max_rank} x (in + out) + out = {width}")
    if weights.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        raise RequestError("lora_weights", f"dtype must be FP16, BF16 or FP32, got {weights.dtype}")
    if config.dtype.is_floating_point:
        raise RequestError("lora_config", f"dtype must be INT32, got {config.dtype}")
    rows = _check_config(config.tolist(), cfg, max_rank, weights.shape[1])
    num_bytes = sum(row[3] for row in rows) * dtype.itemsize
    if num_bytes > max_adapter_bytes:
        raise RequestError("lora_weights", f"adapter of {num_bytes} bytes exceeds lora_cache_max_adapter_size "
                                           f"{max_adapter_bytes}")
    return weights, config, rows


def parse_lora(weights, config, cfg: ModelConfig, dtype: torch.dtype, max_rank: int,
               max_adapter_bytes: int) -> LoraAdapter:
    """Validate (`check_lora`, then finite values) and convert TRT-LLM lora_weights and lora_config."""
    weights, config, rows = check_lora(weights, config, cfg, dtype, max_rank, max_adapter_bytes)
    views = list(_row_views(weights, rows, cfg))
    adapter = packed({key: (a, b) for key, a, b, _ in views}, dtype,
                     magnitudes={key: m for key, _, _, m in views if m is not None})
    if not _all_finite(adapter.buffer):
        raise RequestError("lora_weights", f"contains NaN or Inf values, or values beyond {dtype}'s range")
    return adapter


def _row_views(weights: torch.Tensor, rows: list[Row], cfg: ModelConfig):
    """((layer, module_id), A [rank, in_dim], B [out_dim, rank], magnitude [out_dim] or None) per checked row: views
    of lora_weights; a fused gate_up row (row_shape) as gate (5) and up (7), sharing its A; an expert module's as
    A [experts * rank, in_dim] and B [experts * out_dim, rank], expert e's rows e * rank.. and e * out_dim..."""
    for row, (module_id, layer, rank, need, dora) in zip(weights, rows):
        if module_id in EXPERT_MODULE_NAMES:                  # A [experts * rank, in], B [experts * out, rank]
            num, in_dim, out_dim = expert_module_shape(cfg, module_id)
            yield (layer, module_id), row[:num * rank * in_dim].reshape(num * rank, in_dim), \
                row[num * rank * in_dim:need].reshape(num * out_dim, rank), None
            continue
        in_dim, out_dim = row_shape(cfg, module_id)
        a = row[:rank * in_dim].reshape(rank, in_dim)
        b = row[rank * in_dim:rank * (in_dim + out_dim)].reshape(out_dim, rank)
        m = row[need - out_dim:need] if dora else None
        if module_id in (0, 1, 2) and (order := qk_rows(cfg, module_id)) is not None:     # a partial rotary's
            b, m = b[order], None if m is None else m[order]                                # q and k channels
        if out_dim == module_shape(cfg, module_id)[1]:
            yield (layer, module_id), a, b, m
            continue
        for part, module in enumerate((FUSED_GATE_UP, 7)):
            rows_of = slice(part * cfg.intermediate_size, (part + 1) * cfg.intermediate_size)
            yield (layer, module), a, b[rows_of], None if m is None else m[rows_of]


def qk_rows(cfg: ModelConfig, module_id: int) -> list[int] | None:
    """The order of a q (1), k (2) or fused qkv (0) module's output rows in our channel order (ModelConfig.
    rotary_order), or None where it is the checkpoint's."""
    q, kv = cfg.q_size, cfg.kv_size
    sizes = {0: (q, kv, q + 2 * kv), 1: (q, 0, q), 2: (0, kv, kv)}[module_id]
    return cfg.qk_row_order(*sizes)


def _equal(sent: torch.Tensor, kept: torch.Tensor) -> bool:
    """A sent matrix equals a kept one once stored in the kept dtype (an fp32 upload kept in fp16 is rounded)."""
    return sent.shape == kept.shape and torch.equal(sent.to(kept.dtype), kept)


def _all_finite(t: torch.Tensor) -> bool:
    """No NaN or Inf: the min and max propagate NaN, and are finite only when every value is. One pass over the
    adapter, where isfinite().all() makes a mask of it and amin and amax apart read it twice."""
    if t.numel() == 0:
        return True
    low, high = torch.aminmax(t)
    return bool(torch.isfinite(low) & torch.isfinite(high))


def _check_config(config: list[list[int]], cfg: ModelConfig, max_rank: int, row_width: int) -> list[Row]:
    """Each lora_config row checked: (module_id, layer, rank, values its weights row needs, is_dora)."""
    rows, seen = [], set()
    for i, (module_id, layer, rank, *flags) in enumerate(config):
        dora = flags[0] if flags else 0
        if dora not in (0, 1):
            raise RequestError("lora_config", f"row {i}: is_dora must be 0 or 1, got {dora}")
        if module_id in UNSUPPORTED_MODULES:
            raise RequestError("lora_config", f"row {i}: module {module_id} ({UNSUPPORTED_MODULES[module_id]}) "
                                              "is unsupported: decoder-only models have no cross attention")
        if module_id not in MODULE_NAMES and module_id not in EXPERT_MODULE_NAMES:
            raise RequestError("lora_config", f"row {i}: unknown module id {module_id} (valid: 0-7, 13-17)")
        if not 0 <= layer < cfg.num_layers:
            raise RequestError("lora_config", f"row {i}: layer {layer} out of range [0, {cfg.num_layers})")
        if not 1 <= rank <= max_rank:
            raise RequestError("lora_config", f"row {i}: rank {rank} must be in [1, max_lora_rank {max_rank}]")
        if (why := module_refusal(cfg, module_id, layer)) is not None:
            raise RequestError("lora_config", f"row {i}: {why}")
        if dora and module_id in EXPERT_MODULE_NAMES:
            raise RequestError("lora_config", f"row {i}: DoRA on module {module_id} "
                                              f"({EXPERT_MODULE_NAMES[module_id]}) is not supported (TensorRT-LLM "
                                              "refuses DoRA on a mixture's modules too)")
        if (layer, module_id) in seen:
            raise RequestError("lora_config", f"row {i}: duplicate module {module_id} for layer {layer}")
        if cfg.fused_projections and module_id in (1, 2, 3, 7):
            parts, whole = ("gate and up", "5 (mlp_h_to_4h)") if module_id == 7 else ("q, k and v", "0 (attn_qkv)")
            raise RequestError("lora_config", f"row {i}: module {module_id} ({MODULE_NAMES[module_id]}): "
                                              f"{cfg.architecture} has no such module; its {parts} are one, module "
                                              f"{whole}")
        seen.add((layer, module_id))
        if dora and cfg.qkv_bias and module_id in (0, 1, 2, 3):
            raise RequestError("lora_config", f"row {i}: DoRA on module {module_id} ({MODULE_NAMES[module_id]}) of a "
                                              "projection with a bias (Qwen2's q, k, v) is not supported")
        need = row_need(cfg, module_id, rank, bool(dora))
        if row_width < need:
            what = " with its DoRA magnitude" if dora else ""
            if module_id in EXPERT_MODULE_NAMES:
                num, in_dim, out_dim = expert_module_shape(cfg, module_id)
                what = f" on layer {layer} ({num} experts x rank {rank} x (in {in_dim} + out {out_dim}))"
            name = MODULE_NAMES.get(module_id) or EXPERT_MODULE_NAMES[module_id]
            raise RequestError("lora_weights", f"row {i} has {row_width} values, module {module_id} "
                                               f"({name}) rank {rank}{what} needs {need}")
        rows.append((module_id, layer, rank, need, bool(dora)))
    for layer, module_id in seen:
        if module_id == 0 and any((layer, m) in seen for m in (1, 2, 3)):
            raise RequestError("lora_config", f"layer {layer} has both attn_qkv (0) and attn_q/k/v (1-3) rows")
    return rows
