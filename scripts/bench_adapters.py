"""Random LoRA adapters for the benchmarks: made once with PEFT, used by both the engine and HF + PEFT."""
import tempfile
from functools import lru_cache
from pathlib import Path

import torch

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@lru_cache(maxsize=None)
def adapter_dirs(model_dir: str, ranks: tuple[int, ...]) -> tuple[Path, ...]:
    """One PEFT directory per rank in `ranks` (task id = position + 1), seeded."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    root = Path(tempfile.mkdtemp(prefix="bench-adapters-"))
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = None
    for i, rank in enumerate(ranks):
        torch.manual_seed(i)
        config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS, init_lora_weights="gaussian")
        if model is None:
            model = get_peft_model(base, config, adapter_name=f"t{i + 1}")
        else:
            model.add_adapter(f"t{i + 1}", config)
            model.delete_adapter(f"t{i}")       # one adapter at a time: saving scans every adapter the model holds
        model.save_pretrained(root, selected_adapters=[f"t{i + 1}"])    # into <root>/<name>
    return tuple(root / f"t{i + 1}" for i in range(len(ranks)))


def register_adapters(engine, workload) -> None:
    for task_id, path in enumerate(adapter_dirs(engine.config.model_dir, workload.adapter_ranks), start=1):
        engine.add_lora_dir(task_id, path)


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
