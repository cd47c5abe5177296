"""Adapter directories -> TensorRT-LLM tensors: HF PEFT (adapter_config.json + adapter_model.safetensors) and
TensorRT-LLM (model.lora_weights.npy + model.lora_config.npy)."""
import io
import json
import math
import re
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load as load_safetensors

from backend.lora.dora import BaseWeight, normalized_magnitude
from backend.lora.files import read_adapter_files

MODULE_IDS = {"qkv_proj": 0, "q_proj": 1, "k_proj": 2, "v_proj": 3, "o_proj": 4,
              "gate_proj": 5, "gate_up_proj": 5, "down_proj": 6, "up_proj": 7}    # (fused ones: Phi-3; and
                                                                                   # Qwen2-MoE's shared expert's)
EXPERT_KEY_RE = re.compile(r"\.(experts|block_sparse_moe|gate|shared_expert_gate)\.")   # a mixture's experts, router
EXPERTS_RE = re.compile(                     # a mixture's LoRA: PEFT's stacked experts (target_parameters: gate_up
    r"(?:.*\.)?model\.layers\.(?P<layer>\d+)\.(?:mlp|block_sparse_moe)\."      # and down, nested as base_layer),
    r"(?P<what>experts(?:\.base_layer)*|gate|shared_expert_gate|"               # the router, a shared expert's
    r"experts\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj|w1|w3|w2))"  # gate, or one expert's module
    r"\.lora_(?P<ab>[AB])\.weight$")
EXPERT_PROJ = {"gate_proj": 13, "w1": 13, "up_proj": 15, "w3": 15, "down_proj": 14, "w2": 14}
KEY_RE = re.compile(r"(?:.*\.)?(?P<module>model\.layers\.(?P<layer>\d+)\.\w+(?:\.shared_expert)?\.(?P<proj>\w+))"
                    r"\.lora_(?:(?P<ab>[AB])\.weight|(?P<m>magnitude_vector)(?:\.weight)?)$")
STORAGE_TYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
ADAPTER_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's rank_pattern / alpha_pattern: the first key matching the module name's tail."""
    for pattern, value in patterns.items():
        if re.fullmatch(rf"(.*\.)?({pattern})", module):
            return value
    return default


def peft_to_trtllm(peft_dir: str | Path, storage_type: str = "float16", base_weight: BaseWeight | None = None,
                   model=None) -> tuple[np.ndarray, np.ndarray]:
    """Convert a PEFT LoRA dir to (lora_weights [N, maxrow], lora_config [N, 3] int32), scale folded into B; a DoRA
    one (use_dora) to rows of [N, 4] with is_dora and each magnitude normalized against `base_weight`
    (backend/lora/dora.py), as TensorRT-LLM's converter writes them. bfloat16 weights come back as uint16 (their
    bits), since numpy has no bfloat16. With `model` (a ModelConfig), each A and B is checked against its module's
    shape."""
    return peft_files_to_trtllm(read_adapter_files(peft_dir).files, Path(peft_dir), storage_type, base_weight, model)


def peft_files_to_trtllm(files: dict[str, bytes], peft_dir: Path, storage_type: str = "float16",
                         base_weight: BaseWeight | None = None, model=None) -> tuple[np.ndarray, np.ndarray]:
    """peft_to_trtllm of a folder's files as read (backend/lora/files.py); peft_dir names it in errors."""
    if "adapter_config.json" not in files or "adapter_model.safetensors" not in files:
        raise ValueError(f"{peft_dir}: a PEFT adapter needs adapter_config.json and adapter_model.safetensors")
    cfg = json.loads(files["adapter_config.json"])
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{peft_dir}: peft_type {cfg.get('peft_type')} is not LORA")
    if cfg.get("bias", "none") != "none" or cfg.get("modules_to_save"):
        raise ValueError(f"{peft_dir}: LoRA bias and modules_to_save are not supported")
    dora = bool(cfg.get("use_dora"))
    if dora and base_weight is None:
        raise ValueError(f"{peft_dir}: a DoRA adapter (use_dora) needs the base model's weights to normalize its "
                         "magnitudes (scripts/hf_lora_convert.py --base-model DIR)")
    tensors = load_safetensors(files["adapter_model.safetensors"])
    for key, tensor in tensors.items():
        if tensor.dtype not in ADAPTER_DTYPES:
            raise ValueError(f"{peft_dir}: adapter tensor {key} is {str(tensor.dtype).removeprefix('torch.')}; "
                             "adapters are read in float16, bfloat16 or float32 (a quantized adapter is not)")
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    experts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        if (e := EXPERTS_RE.match(key)) is not None:
            experts.setdefault((int(e["layer"]), e["what"]), {})[e["ab"]] = tensor.float()
            continue
        m = KEY_RE.match(key)
        if m is None or m["proj"] not in MODULE_IDS:
            if EXPERT_KEY_RE.search(key):
                raise ValueError(f"{peft_dir}: adapter tensor {key}: a mixture's LoRA this server does not read "
                                 "(DoRA on experts, router or shared expert gate is not supported)")
            raise ValueError(f"{peft_dir}: unsupported adapter tensor {key}")
        pairs.setdefault(m["module"], {})["M" if m["m"] else m["ab"]] = tensor.float()
    rows, config = [], []
    for module, ab in sorted(pairs.items(), key=lambda kv: (int(kv[0].split(".")[2]), kv[0])):
        if "A" not in ab or "B" not in ab:
            raise ValueError(f"{peft_dir}: {module} needs both lora_A and lora_B")
        a, b = ab["A"], ab["B"]                               # [r, in], [out, r]
        check_shapes(module, a, b, model)
        rank = a.shape[0]
        scale = _scale(cfg, module, rank)
        layer, proj = int(module.split(".")[2]), module.rsplit(".", 1)[1]
        parts = [a.flatten(), (b * scale).flatten()]
        if dora:
            if "M" not in ab:
                raise ValueError(f"{peft_dir}: DoRA module {module} has no lora_magnitude_vector")
            parts.append(normalized_magnitude(ab["M"], a, b * scale, base_weight(layer, MODULE_IDS[proj]),
                                              f"{peft_dir.name}: {module}"))
        rows.append(torch.cat(parts))
        config.append([MODULE_IDS[proj], layer, rank] + ([1] if dora else []))
    if experts:
        if model is None or not model.num_experts:
            raise ValueError(f"{peft_dir}: LoRA on a mixture's experts needs the base model's config (a mixture of "
                             "experts; scripts/hf_lora_convert.py --base-model DIR)")
        for module_id, layer, rank, row in expert_rows(experts, cfg, model, peft_dir):
            rows.append(row)
            config.append([module_id, layer, rank] + ([0] if dora else []))
    width = max(row.numel() for row in rows)
    weights = torch.zeros(len(rows), width)
    for i, row in enumerate(rows):
        weights[i, :row.numel()] = row
    return to_numpy(weights.to(STORAGE_TYPES[storage_type])), np.array(config, dtype=np.int32)


def _scale(cfg: dict, name: str, rank: int) -> float:
    """PEFT's LoRA scale for the module or parameter `name` of per-expert rank `rank`."""
    alpha = _pattern_value(cfg.get("alpha_pattern") or {}, name, cfg.get("lora_alpha", rank))
    return alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank


def expert_rows(experts: dict[tuple[int, str], dict[str, torch.Tensor]], cfg: dict, model, peft_dir: Path):
    """(module_id, layer, rank, row) of TensorRT-LLM's expert modules from PEFT's tensors, scale folded into B: the
    stacked form (A [experts * r, in], expert e's rows e * r..; B [out, experts * r], expert e's columns k * experts +
    e; gate and up one parameter, sharing A: modules 13 and 15 get the same A), one expert's modules (zeros for
    the experts an adapter leaves out), the router (16) and a shared expert's gate (17)."""
    num, h, inter = model.num_experts, model.hidden_size, model.moe_intermediate_size
    singles: dict[tuple[int, int], dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
    for (layer, what), ab in sorted(experts.items()):
        if "A" not in ab or "B" not in ab:
            raise ValueError(f"{peft_dir}: layer {layer} {what} needs both lora_A and lora_B")
        a, b = ab["A"], ab["B"]
        name = f"model.layers.{layer}.mlp.{what}"
        if what in ("gate", "shared_expert_gate"):                        # [r, hidden], [experts or 1, r]
            module, out = (16, num) if what == "gate" else (17, 1)
            if a.shape[1] != h or b.shape != (out, a.shape[0]):
                raise ValueError(f"{peft_dir}: {name}: lora_A {list(a.shape)} and lora_B {list(b.shape)} do not fit "
                                 f"[r, {h}] and [{out}, r]")
            yield module, layer, a.shape[0], torch.cat([a.flatten(), (b * _scale(cfg, name, a.shape[0])).flatten()])
        elif what.startswith("experts.") and what.split(".")[1].isdigit():  # one expert's gate, up or down
            _, expert, proj = what.split(".")
            singles.setdefault((layer, EXPERT_PROJ[proj]), {})[int(expert)] = (a, b * _scale(cfg, name, a.shape[0]))
        else:                                                              # every expert's, stacked
            if a.shape[0] % num or b.shape[1] != a.shape[0]:
                raise ValueError(f"{peft_dir}: {name}: lora_A {list(a.shape)} and lora_B {list(b.shape)} are not "
                                 f"{num} experts' [experts * r, in] and [out, experts * r] (the model's expert count)")
            rank = a.shape[0] // num
            kind = {(h, 2 * inter): "gate_up_proj", (inter, h): "down_proj"}.get((a.shape[1], b.shape[0]))
            if kind is None:
                raise ValueError(f"{peft_dir}: {name}: lora_A {list(a.shape)} and lora_B {list(b.shape)} fit neither "
                                 f"gate_up [{num} * r, {h}], [{2 * inter}, {num} * r] nor down [{num} * r, {inter}], "
                                 f"[{h}, {num} * r]")
            b = (b * _scale(cfg, f"model.layers.{layer}.mlp.experts.{kind}", rank)).reshape(-1, rank, num).permute(
                2, 0, 1)                                                   # [experts, out, r]
            parts = [(13, b[:, :inter]), (15, b[:, inter:])] if kind == "gate_up_proj" else [(14, b)]
            for module, b_part in parts:
                yield module, layer, rank, torch.cat([a.flatten(), b_part.flatten()])
    for (layer, module), by_expert in sorted(singles.items()):
        rank = next(iter(by_expert.values()))[0].shape[0]
        in_dim, out_dim = (inter, h) if module == 14 else (h, inter)
        a, b = torch.zeros(num, rank, in_dim), torch.zeros(num, out_dim, rank)
        for expert, (a_e, b_e) in by_expert.items():
            if expert >= num or a_e.shape != (rank, in_dim) or b_e.shape != (out_dim, rank):
                raise ValueError(f"{peft_dir}: layer {layer} expert {expert}'s module {module}: lora_A "
                                 f"{list(a_e.shape)} and lora_B {list(b_e.shape)} do not fit [{rank}, {in_dim}] and "
                                 f"[{out_dim}, {rank}] of one of {num} experts")
            a[expert], b[expert] = a_e, b_e
        yield module, layer, rank, torch.cat([a.flatten(), b.flatten()])


def check_shapes(module: str, a: torch.Tensor, b: torch.Tensor, model=None) -> None:
    """A [r, in] and B [out, r] of one rank r >= 1, and (with the model) its module's in and out."""
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1] or a.shape[0] < 1:
        raise ValueError(f"{module}: lora_A {list(a.shape)} and lora_B {list(b.shape)} are not [r, in] and [out, r] "
                         "of one rank")
    if model is not None:
        from backend.lora.format import row_shape
        in_dim, out_dim = row_shape(model, MODULE_IDS[module.rsplit(".", 1)[1]])
        if a.shape[1] != in_dim or b.shape[0] != out_dim:
            raise ValueError(f"{module}: lora_A {list(a.shape)} and lora_B {list(b.shape)} do not fit the model's "
                             f"[r, {in_dim}] and [{out_dim}, r]")


def to_numpy(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.int16).numpy().view(np.uint16) if t.dtype == torch.bfloat16 else t.numpy()


def load_lora_dir(path: str | Path, base_weight: BaseWeight | None = None, model=None) -> tuple[np.ndarray, np.ndarray]:
    """(lora_weights, lora_config) from a PEFT or TensorRT-LLM adapter directory (a PEFT DoRA one normalized against
    base_weight, a PEFT one checked against `model`'s shapes), its files read safely (backend/lora/files.py)."""
    files = read_adapter_files(path).files
    if "adapter_config.json" in files:
        return peft_files_to_trtllm(files, Path(path), "float32", base_weight, model)
    if "model.lora_weights.npy" in files and "model.lora_config.npy" in files:
        return load_npy(files, "model.lora_weights.npy"), load_npy(files, "model.lora_config.npy")
    raise FileNotFoundError(f"{path} holds neither a PEFT adapter (adapter_config.json) nor TensorRT-LLM "
                            "files (model.lora_weights.npy, model.lora_config.npy)")


def load_npy(files: dict[str, bytes], name: str) -> np.ndarray:
    if name not in files:
        raise FileNotFoundError(f"{name} is missing")
    return np.load(io.BytesIO(files[name]), allow_pickle=False)


def save_trtllm(out_dir: str | Path, weights: np.ndarray, config: np.ndarray) -> None:
    """Write the TensorRT-LLM files with their leading batch dim: [1, N, maxrow] and [1, N, 3|4]."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    np.save(out_dir / "model.lora_weights.npy", weights[None])
    np.save(out_dir / "model.lora_config.npy", config[None])


def prefetch_dirs(root: str | Path) -> list[tuple[int, Path]]:
    """<root>/<task_id>/ adapter directories, by task id."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"lora_prefetch_dir {root} does not exist")
    return sorted((int(p.name), p) for p in root.iterdir() if p.is_dir() and p.name.isdigit())
