"""Random LoRA adapters for the benchmarks: made once with PEFT, used by both the engine and HF + PEFT."""
import atexit
import json
import shutil
import tempfile
from functools import lru_cache
from pathlib import Path

import torch

from backend.model.checkpoint import ModelConfig

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


@lru_cache(maxsize=None)
def adapter_dirs(model_dir: str, ranks: tuple[int, ...]) -> tuple[Path, ...]:
    """One PEFT directory per rank in `ranks` (task id = position + 1), seeded: A ~ N(0, 1/rank), B ~ N(0, 0.02),
    written directly (no model instance, so an 8B shape costs seconds); removed when the process exits. On every
    module a layer has: a mixture's layers on attention, every expert (and a shared expert)."""
    from safetensors.torch import save_file
    cfg = ModelConfig.from_dir(model_dir)
    root = Path(tempfile.mkdtemp(prefix="bench-adapters-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)          # up to 280 MB a run: 300 runs filled a disk
    shapes = {"q_proj": (cfg.hidden_size, cfg.q_size), "k_proj": (cfg.hidden_size, cfg.kv_size),
              "v_proj": (cfg.hidden_size, cfg.kv_size), "o_proj": (cfg.q_size, cfg.hidden_size),
              "gate_proj": (cfg.hidden_size, cfg.intermediate_size),
              "up_proj": (cfg.hidden_size, cfg.intermediate_size),
              "down_proj": (cfg.intermediate_size, cfg.hidden_size)}
    for i, rank in enumerate(ranks):
        g = torch.Generator().manual_seed(i)
        tensors = {}
        for layer in range(cfg.num_layers):
            for name, (in_dim, out_dim) in shapes.items():
                if name not in ATTENTION and not cfg.has_dense_mlp(layer):      # a mixture: attention only
                    continue
                part = "self_attn" if name in ATTENTION else "mlp.shared_expert" if cfg.is_moe(layer) else "mlp"
                key = f"base_model.model.model.layers.{layer}.{part}.{name}"
                tensors[f"{key}.lora_A.weight"] = (torch.randn(rank, in_dim, generator=g) / rank).to(torch.float16)
                tensors[f"{key}.lora_B.weight"] = (torch.randn(out_dim, rank, generator=g) * 0.02).to(torch.float16)
            if cfg.is_moe(layer):                                             # every expert, as PEFT stacks them
                tensors |= expert_tensors(cfg, layer, rank, g)
        path = root / f"t{i + 1}"
        path.mkdir()
        save_file(tensors, path / "adapter_model.safetensors")
        (path / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0,
            "target_modules": TARGETS, "bias": "none", "base_model_name_or_path": model_dir}
            | ({"target_parameters": EXPERTS} if cfg.num_experts else {})))
    return tuple(root / f"t{i + 1}" for i in range(len(ranks)))


def expert_tensors(cfg: ModelConfig, layer: int, rank: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    """A mixture layer's LoRA on every expert in PEFT's stacked form (target_parameters: gate_up nested as
    base_layer, then down): lora_A [experts * rank, in], lora_B [out, experts * rank]."""
    num, h, inter = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    key = f"base_model.model.model.layers.{layer}.mlp.experts"
    tensors = {}
    for name, (in_dim, out_dim) in ((f"{key}.base_layer", (h, 2 * inter)), (key, (inter, h))):
        tensors[f"{name}.lora_A.weight"] = (torch.randn(num * rank, in_dim, generator=g) / rank).to(torch.float16)
        tensors[f"{name}.lora_B.weight"] = (torch.randn(out_dim, num * rank, generator=g) * 0.02).to(torch.float16)
    return tensors


def register_adapters(engine, workload) -> None:
    for task_id, path in enumerate(adapter_dirs(engine.config.model_dir, workload.adapter_ranks), start=1):
        engine.add_lora_dir(task_id, path)


def register_copies(engine, ranks: tuple[int, ...], num_task_ids: int) -> None:
    """Task ids 1..num_task_ids, id k holding the adapter of rank ranks[(k - 1) % len(ranks)]: each PEFT file parsed
    once (seconds at the 8B shape) and cached under its share of the ids, which the engine keeps apart (slots,
    uploads) as any distinct adapters."""
    from backend.lora.dora import checkpoint_weights
    from backend.lora.peft import load_lora_dir
    model_dir = engine.config.model_dir
    base = checkpoint_weights(model_dir, engine.runner.dtype, engine.runner.device)
    parsed = [load_lora_dir(path, base, engine.model_config) for path in adapter_dirs(model_dir, ranks)]
    for task_id in range(1, num_task_ids + 1):
        engine.add_lora(task_id, *parsed[(task_id - 1) % len(parsed)])


def attach_peft_adapters(model, workload, loaded: int | None = None):
    """Load the workload's adapters (the first `loaded` of them; all by default) into an HF model:
    (PeftModel, {task_id: adapter name})."""
    from peft import PeftModel
    dirs = adapter_dirs(model.config._name_or_path, workload.adapter_ranks)
    peft = PeftModel.from_pretrained(model, dirs[0], adapter_name="t1")
    for task_id, path in enumerate(dirs[1:loaded], start=2):
        peft.load_adapter(path, adapter_name=f"t{task_id}")
    return peft.eval(), {task_id: f"t{task_id}" for task_id in range(1, len(dirs) + 1)}


def swap_adapters(peft, workload, task_ids: set[int]) -> None:
    """Keep exactly the adapters a batch needs loaded: what an HF server without an adapter cache does."""
    dirs = adapter_dirs(peft.base_model.model.config._name_or_path, workload.adapter_ranks)
    loaded = {int(name[1:]) for name in peft.peft_config}
    for task_id in loaded - task_ids:
        if len(peft.peft_config) > 1:
            peft.delete_adapter(f"t{task_id}")
    for task_id in task_ids - loaded:
        peft.load_adapter(dirs[task_id - 1], adapter_name=f"t{task_id}")
