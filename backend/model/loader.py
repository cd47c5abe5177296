"""Hugging Face safetensors -> our weights: a translation table, fused projections, experts stacked, tensor-parallel
slices."""
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from backend.model.checkpoint import CheckpointReader, ModelConfig
from kernels.quant import QUANTIZED_WEIGHTS, GroupedWeight, QuantizedWeight, quantize_weight

KEPT_FORMATS = {"auto": ("int4", "fp8"), "int4": ("int4",), "fp8": ("fp8",), "int8": ()}   # by weight_dtype: the
                                              # checkpoint formats whose projections are kept as stored


@dataclass(frozen=True, slots=True)
class Source:
    """Checkpoint tensors that make one of our parameters, concatenated along dim 0, and how TP splits them."""
    keys: tuple[str, ...]
    split: str = "none"                       # "column" (dim 0 of each part), "row" (dim 1), "none", or "qkv":
                                              # q by heads, k and v by KV heads (ModelConfig.kv_head_part); and
                                              # "fused_qkv" / "fused_column": the same over one fused tensor;
                                              # "experts_column" / "experts_row": one expert's (gate, up) pair, or
                                              # its down, after another, stacked into [num_experts, ...] and each
                                              # split as column / row; "fused_experts_column" / "fused_experts_row":
                                              # the same from transformers' stacked [num_experts, ...] tensor


def translation_table(cfg: ModelConfig, keys=frozenset()) -> dict[str, Source]:
    """Our parameter names -> checkpoint names, per architecture; `keys` (the checkpoint's) say in which form a
    mixture's experts are stored."""
    table = {
        "embed_tokens": Source(("model.embed_tokens.weight",)),
        "norm": Source(("model.norm.weight",)),
        "lm_head": Source(("model.embed_tokens.weight",) if cfg.tie_word_embeddings else ("lm_head.weight",)),
    }
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}"
        attn = [f"{p}.self_attn.{name}_proj" for name in ("q", "k", "v")]
        table |= {
            f"layers.{i}.input_norm": Source((f"{p}.input_layernorm.weight",)),
            f"layers.{i}.qkv_proj": Source(tuple(a + ".weight" for a in attn), "qkv"),
            f"layers.{i}.o_proj": Source((f"{p}.self_attn.o_proj.weight",), "row"),
            f"layers.{i}.post_attn_norm": Source((f"{p}.post_attention_layernorm.weight",)),
            f"layers.{i}.gate_up_proj": Source((f"{p}.mlp.gate_proj.weight", f"{p}.mlp.up_proj.weight"), "column"),
            f"layers.{i}.down_proj": Source((f"{p}.mlp.down_proj.weight",), "row"),
        }
        if cfg.sandwich_norms:                                 # (Gemma: its pre-MLP norm is our post_attn_norm)
            table |= {f"layers.{i}.attn_out_norm": Source((f"{p}.post_attention_layernorm.weight",)),
                      f"layers.{i}.post_attn_norm": Source((f"{p}.pre_feedforward_layernorm.weight",)),
                      f"layers.{i}.mlp_out_norm": Source((f"{p}.post_feedforward_layernorm.weight",))}
        if cfg.fused_projections:                              # one checkpoint tensor each, cut into its parts
            table[f"layers.{i}.qkv_proj"] = Source((f"{p}.self_attn.qkv_proj.weight",), "fused_qkv")
            table[f"layers.{i}.gate_up_proj"] = Source((f"{p}.mlp.gate_up_proj.weight",), "fused_column")
        if cfg.qkv_bias:
            table[f"layers.{i}.qkv_bias"] = Source(tuple(a + ".bias" for a in attn), "qkv")
        if cfg.qk_norm:                                        # [head_dim], the same for every head: every rank's
            table |= {f"layers.{i}.{x}_norm": Source((f"{p}.self_attn.{x}_norm.weight",)) for x in ("q", "k")}
        if cfg.is_moe(i):
            table = experts_table(cfg, table, i, keys)
    return table


def experts_table(cfg: ModelConfig, table: dict[str, Source], i: int, keys) -> dict[str, Source]:
    """Layer i's mixture of experts in place of its MLP: the router [num_experts, hidden], the experts' gate and up
    [num_experts, 2 x moe_intermediate, hidden] (gate rows first) and down [num_experts, hidden, moe_intermediate],
    and Qwen2-MoE's shared expert as the layer's dense MLP (gate_up_proj, down_proj) with its gate [1, hidden].
    The experts stored one by one (`experts.N.gate_proj`, Mixtral's `experts.N.w1` (gate), `w3` (up) and `w2`
    (down)) or stacked as transformers 5 holds them (`experts.gate_up_proj`, `experts.down_proj`)."""
    mixtral = cfg.architecture == "MixtralForCausalLM"
    p = f"model.layers.{i}.{'block_sparse_moe' if mixtral else 'mlp'}"
    gate, up, down = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    table = {name: source for name, source in table.items()
             if name not in (f"layers.{i}.gate_up_proj", f"layers.{i}.down_proj")}
    table[f"layers.{i}.router"] = Source((f"{p}.gate.weight",))
    if f"{p}.experts.gate_up_proj" in keys:
        table[f"layers.{i}.experts_gate_up"] = Source((f"{p}.experts.gate_up_proj",), "fused_experts_column")
        table[f"layers.{i}.experts_down"] = Source((f"{p}.experts.down_proj",), "fused_experts_row")
    else:
        experts = range(cfg.num_experts)
        table[f"layers.{i}.experts_gate_up"] = Source(tuple(f"{p}.experts.{e}.{name}.weight" for e in experts
                                                            for name in (gate, up)), "experts_column")
        table[f"layers.{i}.experts_down"] = Source(tuple(f"{p}.experts.{e}.{down}.weight" for e in experts),
                                                   "experts_row")
    if cfg.shared_expert:
        table |= {f"layers.{i}.gate_up_proj": Source((f"{p}.shared_expert.gate_proj.weight",
                                                      f"{p}.shared_expert.up_proj.weight"), "column"),
                  f"layers.{i}.down_proj": Source((f"{p}.shared_expert.down_proj.weight",), "row"),
                  f"layers.{i}.shared_expert_gate": Source((f"{p}.shared_expert_gate.weight",))}
    return table


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Full (unsplit) shape of every checkpoint tensor we read."""
    h, q, kv, inter = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,),
              "lm_head.weight": (cfg.vocab_size, h)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}"
        shapes |= {
            f"{p}.input_layernorm.weight": (h,), f"{p}.post_attention_layernorm.weight": (h,),
            f"{p}.pre_feedforward_layernorm.weight": (h,), f"{p}.post_feedforward_layernorm.weight": (h,),
            f"{p}.self_attn.q_proj.weight": (q, h), f"{p}.self_attn.k_proj.weight": (kv, h),
            f"{p}.self_attn.v_proj.weight": (kv, h), f"{p}.self_attn.o_proj.weight": (h, q),
            f"{p}.self_attn.q_proj.bias": (q,), f"{p}.self_attn.k_proj.bias": (kv,),
            f"{p}.self_attn.v_proj.bias": (kv,),
            f"{p}.self_attn.q_norm.weight": (cfg.head_dim,), f"{p}.self_attn.k_norm.weight": (cfg.head_dim,),
            f"{p}.mlp.gate_proj.weight": (inter, h), f"{p}.mlp.up_proj.weight": (inter, h),
            f"{p}.mlp.down_proj.weight": (h, inter),
            f"{p}.self_attn.qkv_proj.weight": (q + 2 * kv, h), f"{p}.mlp.gate_up_proj.weight": (2 * inter, h),
        }
        if cfg.num_experts:
            shapes |= experts_shapes(cfg, i)
    return shapes


def experts_shapes(cfg: ModelConfig, i: int) -> dict[str, tuple[int, ...]]:
    """The checkpoint shapes of layer i's mixture, in each form experts_table reads."""
    h, inter, num = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
    shapes = {}
    for p, names in ((f"model.layers.{i}.mlp", ("gate_proj", "up_proj", "down_proj")),
                     (f"model.layers.{i}.block_sparse_moe", ("w1", "w3", "w2"))):
        shapes |= {f"{p}.gate.weight": (num, h), f"{p}.experts.gate_up_proj": (num, 2 * inter, h),
                   f"{p}.experts.down_proj": (num, h, inter), f"{p}.shared_expert_gate.weight": (1, h),
                   f"{p}.shared_expert.gate_proj.weight": (cfg.intermediate_size, h),
                   f"{p}.shared_expert.up_proj.weight": (cfg.intermediate_size, h),
                   f"{p}.shared_expert.down_proj.weight": (h, cfg.intermediate_size)}
        for e in range(num):
            expert = f"{p}.experts.{e}"
            shapes |= {f"{expert}.{names[0]}.weight": (inter, h), f"{expert}.{names[1]}.weight": (inter, h),
                       f"{expert}.{names[2]}.weight": (h, inter)}
    return shapes


def _checked_slice(reader: CheckpointReader, key: str, shape: tuple[int, ...]):
    """The checkpoint tensor `key`, unread (a safetensors slice), once its shape is the expected one."""
    tensor = reader.get_slice(key)
    actual = tuple(tensor.get_shape())
    if actual != shape:
        raise ValueError(f"checkpoint tensor {key} has shape {list(actual)}, expected {list(shape)}")
    return tensor


def _read_slice(reader: CheckpointReader, key: str, shape: tuple[int, ...], dim: int | None, parts: int,
                index: int) -> torch.Tensor:
    """Part `index` of `parts` equal parts along `dim` (None: the whole tensor)."""
    return _sliced(_checked_slice(reader, key, shape), shape, dim, parts, index, key)


def _sliced(tensor, shape: tuple[int, ...], dim: int | None, parts: int, index: int, key: str = "") -> torch.Tensor:
    if dim is None or parts == 1:
        return tensor[:]
    if shape[dim] % parts:
        raise ValueError(f"{key}: dim {dim} of size {shape[dim]} does not split into {parts} parts")
    size = shape[dim] // parts
    lo, hi = index * size, (index + 1) * size
    return tensor[lo:hi] if dim == 0 else tensor[:, lo:hi]


def _part(cfg: ModelConfig, split: str, key: str, tp_size: int, tp_rank: int) -> tuple[int | None, int, int]:
    """(dim, parts, index) of the slice of checkpoint tensor `key` that rank tp_rank reads."""
    if split == "qkv" and not key.split(".")[-2].startswith("q_"):
        parts, index, _ = cfg.kv_head_part(tp_size, tp_rank)
        return 0, parts, index
    return {"column": 0, "qkv": 0, "row": 1}.get(split), tp_size, tp_rank


def _read_experts(read, key_shapes: list[tuple[str, tuple[int, ...]]], split: str, tp_size: int,
                  tp_rank: int) -> torch.Tensor:
    """This rank's share of every expert, stacked: [num_experts, 2 x inter, hidden] for gate and up (each's rows
    split: this rank's gate rows, then its up rows) or [num_experts, hidden, inter] for down (its columns split).
    read(key) -> the checkpoint tensor's unread slice."""
    column = split.endswith("column")
    if split.startswith("fused"):
        [(key, shape)] = key_shapes
        tensor = read(key)
        if column:
            inter = shape[1] // 2
            size, lo = inter // tp_size, tp_rank * (inter // tp_size)
            return torch.cat([tensor[:, lo:lo + size], tensor[:, inter + lo:inter + lo + size]], dim=1)
        size = shape[2] // tp_size
        return tensor[:, :, tp_rank * size:(tp_rank + 1) * size]
    pieces = [_sliced(read(key), shape, 0 if column else 1, tp_size, tp_rank) for key, shape in key_shapes]
    if column:                                                 # (gate, up) of each expert in turn
        return torch.stack([torch.cat(pair) for pair in zip(pieces[::2], pieces[1::2])])
    return torch.stack(pieces)


def _read_fused(reader: CheckpointReader, key: str, shape: tuple[int, ...], cfg: ModelConfig, split: str,
                tp_size: int, tp_rank: int) -> torch.Tensor:
    """This rank's rows of a fused checkpoint tensor: of q, k and v each (fused_qkv: q by heads, k and v by KV
    heads), or of gate and up each (fused_column), in that order."""
    tensor = _checked_slice(reader, key, shape)               # read piece by piece: each rank its own rows only
    if split == "fused_qkv":
        q, kv = cfg.q_size, cfg.kv_size
        kv_parts, kv_index, _ = cfg.kv_head_part(tp_size, tp_rank)
        bounds = [0, q, q + kv, q + 2 * kv]
        layout = [(tp_size, tp_rank), (kv_parts, kv_index), (kv_parts, kv_index)]
    else:
        bounds, layout = [0, shape[0] // 2, shape[0]], [(tp_size, tp_rank)] * 2
    pieces = []
    for (lo, hi), (parts, index) in zip(zip(bounds, bounds[1:]), layout):
        size = (hi - lo) // parts
        pieces.append(tensor[lo + index * size:lo + (index + 1) * size])
    return _cat_rows(pieces)


def _cat_rows(parts: list, dtype: torch.dtype | None = None):
    """The output rows of parts one after another: weights kept as stored where every part is one of one type,
    group size and input order (else dequantized into dtype), tensors concatenated."""
    if all(isinstance(part, GroupedWeight) for part in parts) and len({type(p) for p in parts}) == 1 and \
            len({p.group_size for p in parts}) == 1 and all(parts[0].same_input_order(p) for p in parts):
        return type(parts[0]).cat(parts) if len(parts) > 1 else parts[0]
    parts = [part.dequantize(dtype or torch.float32) if isinstance(part, GroupedWeight) else part for part in parts]
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def _on_device(part, device, dtype: torch.dtype):
    """A part as read, on the device: a tensor in dtype, a weight kept as stored as it is."""
    return part.to(device) if isinstance(part, GroupedWeight) else part.to(device).to(dtype)


def load_weights(model_dir: str | Path, cfg: ModelConfig, dtype: torch.dtype, device="cpu",
                 tp_size: int = 1, tp_rank: int = 0, lm_head: bool = True, weight_dtype: str = "auto",
                 lm_head_dtype: str = "auto", projection_dtype: torch.dtype | None = None,
                 prepare: Callable = lambda name, weight: weight) -> dict[str, torch.Tensor | QuantizedWeight]:
    """Read every parameter of the model, fused and sliced for this tensor-parallel rank, onto the device: one
    checkpoint tensor at a time passes through host memory, never the whole model. lm_head=False leaves out the
    LM head (a tensor-parallel worker's: rank 0 computes the logits; vocab x hidden, 1 GB on Llama-3.1-8B in bf16).
    weight_dtype int8, int4, fp8: each dense projection (q/k/v, o, gate/up, down; not the experts, router,
    embeddings or LM head) quantized as it is read (served_weight), so a whole model never lies in memory in full
    precision; a row-parallel one (o, down) read whole and quantized before its columns are sliced, so that each
    rank's share has the scales of the whole rows (INT4: its groups): the ranks' partial sums add up to one rank's
    GEMM. lm_head_dtype int8, int4, fp8: the LM head quantized so too (a tied one beside the embeddings it copies).
    projection_dtype: the dense projections and the LM head where not quantized, if not in dtype (bf16 weights
    beside fp32 activations: backend.device.projection_dtype); quantized ones are quantized from dtype's values.
    prepare(name, weight): each weight as the kernels take it (ops.prepare_weight), applied as soon as it is read,
    so that a weight prepared into fewer bytes (a bf16 checkpoint's in bf16 panels beside fp32 activations) is never
    held whole in the wider dtype.
    weight_dtype auto over an FP8 or a 4-bit GPTQ or AWQ checkpoint (or fp8, int4 over its own format): its dense
    projections kept as stored (CheckpointReader.keep: KEPT_FORMATS), sliced and fused as such."""
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank {tp_rank} out of range for tp_size {tp_size}")
    reader = CheckpointReader(model_dir)
    shapes = expected_shapes(cfg)
    table = translation_table(cfg, reader.key_files.keys())
    refuse_unread_tensors(reader, table, cfg)
    weights = {}
    try:
        for name, source in table.items():
            if name == "lm_head" and not lm_head:
                continue
            dense = name.endswith("_proj") and "experts" not in source.split
            reader.keep = KEPT_FORMATS[weight_dtype] if dense else ()
            if "experts" in source.split:
                read = lambda key: _checked_slice(reader, key, shapes[key])  # noqa: E731
                experts = _read_experts(read, [(key, shapes[key]) for key in source.keys], source.split, tp_size,
                                        tp_rank)
                weights[name] = prepare(name, experts.to(device).to(dtype).contiguous())
                continue
            if weight_dtype != "auto" and source.split == "row" and tp_size > 1 and name.endswith("_proj"):
                [key] = source.keys
                whole = served_weight(name, _on_device(_read_slice(reader, key, shapes[key], None, 1, 0), device,
                                                       dtype), weight_dtype)
                in_dim = shapes[key][1]
                if in_dim % tp_size:
                    raise ValueError(f"{key}: dim 1 of size {in_dim} does not split into {tp_size} parts")
                size = in_dim // tp_size
                try:
                    weights[name] = prepare(name, whole.input_slice(tp_rank * size, (tp_rank + 1) * size))
                except ValueError as err:
                    raise ValueError(f"{key} at tp_size {tp_size}: {err}") from None
                continue
            parts = []
            for key in source.keys:
                if source.split.startswith("fused"):
                    part = _read_fused(reader, key, shapes[key], cfg, source.split, tp_size, tp_rank)
                else:
                    part = _read_slice(reader, key, shapes[key], *_part(cfg, source.split, key, tp_size, tp_rank))
                if cfg.norm_offset and name.endswith("norm"):   # 1 + w, summed in fp32 as the model does
                    part = part.float() + cfg.norm_offset
                parts.append(_on_device(part, device, dtype))
            weight = reordered(cfg, name, _cat_rows(parts, dtype), tp_size)
            parameter, kind = ("lm_head_dtype", lm_head_dtype) if name == "lm_head" else ("weight_dtype", weight_dtype)
            try:
                served = served_weight(name, weight, kind, projection_dtype)
            except ValueError as err:
                raise ValueError(f"{parameter} {kind}: {err}") from None
            weights[name] = prepare(name, served)
    finally:
        reader.close()
    return weights


def served_weight(name: str, weight: torch.Tensor | GroupedWeight, weight_dtype: str,
                  projection_dtype: torch.dtype | None = None) -> torch.Tensor | QuantizedWeight:
    """A dense projection's weight or the LM head as weight_dtype serves it (kernels.quant.quantize_weight; one
    kept packed from the checkpoint as it is), in projection_dtype where not quantized and given; any other as it
    is."""
    if isinstance(weight, QUANTIZED_WEIGHTS):
        return weight
    if not (name.endswith("_proj") or name == "lm_head"):
        return weight.contiguous()
    served = quantize_weight(weight.contiguous(), weight_dtype)
    return served.to(projection_dtype) if projection_dtype is not None and isinstance(served, torch.Tensor) else served


KV_SCALE_LAYOUTS = (("self_attn.k_scale", "self_attn.v_scale"),   # each layer's FP8 KV cache scales: vLLM's and
                    ("self_attn.kv_scale", "self_attn.kv_scale"))  # compressed-tensors'; AutoFP8's one for both


def kv_scale_keys(reader: CheckpointReader, cfg: ModelConfig) -> list[tuple[str, str]] | None:
    """Each layer's (K scale, V scale) keys where an FP8 checkpoint holds an FP8 KV cache's scales (a layout of
    KV_SCALE_LAYOUTS in every layer), else None. compressed-tensors declares them (kv_cache_scheme); quant_method
    fp8 does not: their presence does, as vLLM reads them."""
    storage = reader.storage
    if storage is None or storage.method != "fp8":
        return None
    for k_name, v_name in KV_SCALE_LAYOUTS:
        keys = [(f"model.layers.{i}.{k_name}", f"model.layers.{i}.{v_name}") for i in range(cfg.num_layers)]
        if all(k in reader and v in reader for k, v in keys):
            return keys
    if storage.kv_scales:
        raise ValueError("quantization_config: kv_cache_scheme without each layer's self_attn.k_scale and v_scale")
    return None


def checkpoint_kv_scales(model_dir: str | Path, cfg: ModelConfig) -> list[tuple[float, float]] | None:
    """Each layer's FP8 KV cache scales (k_scale, v_scale) where the checkpoint has them (kv_scale_keys), else
    None."""
    reader = CheckpointReader(model_dir)
    try:
        keys = kv_scale_keys(reader, cfg)
        if keys is None:
            return None
        scales = []
        for i, layer_keys in enumerate(keys):
            pair = [reader.get_slice(key)[:].float() for key in layer_keys]
            if any(t.numel() != 1 or not bool(t.reshape(()) > 0) for t in pair):
                raise ValueError(f"checkpoint layer {i}'s KV scales {[t.tolist() for t in pair]}: one positive "
                                 "value each (a scale per tensor)")
            scales.append(tuple(float(t.reshape(())) for t in pair))
        return scales
    finally:
        reader.close()


def refuse_unread_tensors(reader: CheckpointReader, table: dict[str, Source], cfg: ModelConfig) -> None:
    """Every checkpoint tensor is one we read (or a tied LM head's copy of the embeddings, RoPE's cached
    frequencies, or the FP8 KV cache's scales where an FP8 checkpoint holds them: kv_scale_keys): a tensor we
    would leave out changes the model (a bias, a scale, a quantized weight's zeros)."""
    read = reader.read_keys(key for source in table.values() for key in source.keys)
    read |= {key for layer_keys in kv_scale_keys(reader, cfg) or () for key in layer_keys}
    if cfg.tie_word_embeddings:
        read.add("lm_head.weight")
    unread = sorted(key for key in reader.key_files if key not in read and not key.endswith("rotary_emb.inv_freq"))
    if unread:
        more = f" and {len(unread) - 3} more" if len(unread) > 3 else ""
        raise ValueError(f"checkpoint in {reader.model_dir} holds tensors this server does not read: "
                         f"{', '.join(unread[:3])}{more} (a {cfg.architecture} reads none of them)")


def reordered(cfg: ModelConfig, name: str, weight: torch.Tensor, tp_size: int) -> torch.Tensor:
    """A partial rotary's q and k channels in our order (ModelConfig.rotary_order): this rank's qkv rows (weight,
    bias) and the head norms; any other weight as it is."""
    if cfg.rotary_order() is None:
        return weight
    if name.endswith(("qkv_proj", "qkv_bias")):
        shard = cfg.shard(tp_size)
        order = cfg.qk_row_order(shard.q_size, shard.kv_size, weight.shape[0])
        return weight.output_rows(order) if isinstance(weight, GroupedWeight) else weight[order]
    if name.endswith(("q_norm", "k_norm")):
        return weight[cfg.rotary_order()]
    return weight
