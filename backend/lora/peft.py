"""Adapter directories -> TensorRT-LLM tensors: HF PEFT (adapter_config.json + adapter_model.safetensors) and
TensorRT-LLM (model.lora_weights.npy + model.lora_config.npy)."""
import json
import math
import re
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from backend.lora.dora import BaseWeight, normalized_magnitude

MODULE_IDS = {"qkv_proj": 0, "q_proj": 1, "k_proj": 2, "v_proj": 3, "o_proj": 4,
              "gate_proj": 5, "down_proj": 6, "up_proj": 7}
KEY_RE = re.compile(r"(?:.*\.)?(?P<module>model\.layers\.(?P<layer>\d+)\.\w+\.(?P<proj>\w+))"
                    r"\.lora_(?:(?P<ab>[AB])\.weight|(?P<m>magnitude_vector)(?:\.weight)?)$")
STORAGE_TYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's rank_pattern / alpha_pattern: the first key matching the module name's tail."""
    for pattern, value in patterns.items():
        if re.fullmatch(rf"(.*\.)?({pattern})", module):
            return value
    return default


def peft_to_trtllm(peft_dir: str | Path, storage_type: str = "float16",
                   base_weight: BaseWeight | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Convert a PEFT LoRA dir to (lora_weights [N, maxrow], lora_config [N, 3] int32), scale folded into B; a DoRA
    one (use_dora) to rows of [N, 4] with is_dora and each magnitude normalized against `base_weight`
    (backend/lora/dora.py), as TensorRT-LLM's converter writes them. bfloat16 weights come back as uint16 (their
    bits), since numpy has no bfloat16."""
    peft_dir = Path(peft_dir)
    cfg = json.loads((peft_dir / "adapter_config.json").read_text())
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{peft_dir}: peft_type {cfg.get('peft_type')} is not LORA")
    if cfg.get("bias", "none") != "none" or cfg.get("modules_to_save"):
        raise ValueError(f"{peft_dir}: LoRA bias and modules_to_save are not supported")
    dora = bool(cfg.get("use_dora"))
    if dora and base_weight is None:
        raise ValueError(f"{peft_dir}: a DoRA adapter (use_dora) needs the base model's weights to normalize its "
                         "magnitudes (scripts/hf_lora_convert.py --base-model DIR)")
    tensors = load_file(peft_dir / "adapter_model.safetensors")
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = KEY_RE.match(key)
        if m is None or m["proj"] not in MODULE_IDS:
            raise ValueError(f"{peft_dir}: unsupported adapter tensor {key}")
        pairs.setdefault(m["module"], {})["M" if m["m"] else m["ab"]] = tensor.float()
    rows, config = [], []
    for module, ab in sorted(pairs.items(), key=lambda kv: (int(kv[0].split(".")[2]), kv[0])):
        a, b = ab["A"], ab["B"]                               # [r, in], [out, r]
        rank = a.shape[0]
        alpha = _pattern_value(cfg.get("alpha_pattern") or {}, module, cfg.get("lora_alpha", rank))
        scale = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
        layer, proj = int(module.split(".")[2]), module.rsplit(".", 1)[1]
        parts = [a.flatten(), (b * scale).flatten()]
        if dora:
            if "M" not in ab:
                raise ValueError(f"{peft_dir}: DoRA module {module} has no lora_magnitude_vector")
            parts.append(normalized_magnitude(ab["M"], a, b * scale, base_weight(layer, MODULE_IDS[proj]),
                                              f"{peft_dir.name}: {module}"))
        rows.append(torch.cat(parts))
        config.append([MODULE_IDS[proj], layer, rank] + ([1] if dora else []))
    width = max(row.numel() for row in rows)
    weights = torch.zeros(len(rows), width)
    for i, row in enumerate(rows):
        weights[i, :row.numel()] = row
    return to_numpy(weights.to(STORAGE_TYPES[storage_type])), np.array(config, dtype=np.int32)


def to_numpy(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.int16).numpy().view(np.uint16) if t.dtype == torch.bfloat16 else t.numpy()


def load_lora_dir(path: str | Path, base_weight: BaseWeight | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(lora_weights, lora_config) from a PEFT or TensorRT-LLM adapter directory (a PEFT DoRA one normalized against
    base_weight)."""
    path = Path(path)
    if (path / "adapter_config.json").is_file():
        return peft_to_trtllm(path, "float32", base_weight)
    if (path / "model.lora_weights.npy").is_file() and (path / "model.lora_config.npy").is_file():
        return np.load(path / "model.lora_weights.npy"), np.load(path / "model.lora_config.npy")
    raise FileNotFoundError(f"{path} holds neither a PEFT adapter (adapter_config.json) nor TensorRT-LLM "
                            "files (model.lora_weights.npy, model.lora_config.npy)")


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
