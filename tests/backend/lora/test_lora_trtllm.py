"""An oracle that does not go through our PEFT converter: TensorRT-LLM lora tensors built by hand (fused qkv as
module 0, gate/down/up as modules 5/6/7, odd ranks), their deltas B @ A merged into the HF weights; the engine's
greedy tokens with the adapter equal HF greedy on the merged model, and base rows equal the unmerged model."""
import numpy as np
import pytest
import torch

from backend import LLMEngine
from backend.model.checkpoint import ModelConfig
from tests.helpers import CUDA_MARKS, INTERPRETER_MARK, hf_greedy, random_prompts


def hand_built_adapter(cfg: ModelConfig, seed: int = 7) -> tuple[np.ndarray, np.ndarray, dict[str, torch.Tensor]]:
    """(lora_weights [N, width] fp32, lora_config [N, 3], {HF parameter name: delta [out, in]})."""
    g = torch.Generator().manual_seed(seed)
    h, q, kv, inter = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    rows, config, deltas = [], [], {}

    def module(module_id: int, layer: int, rank: int, in_dim: int, out_dim: int) -> torch.Tensor:
        a = torch.randn(rank, in_dim, generator=g) * 0.15
        b = torch.randn(out_dim, rank, generator=g) * 0.15
        rows.append(torch.cat([a.flatten(), b.flatten()]))
        config.append([module_id, layer, rank])
        return b @ a

    for layer in range(cfg.num_layers):
        p = f"model.layers.{layer}"
        qkv = module(0, layer, 3 + 4 * layer, h, q + 2 * kv)
        deltas |= {f"{p}.self_attn.q_proj.weight": qkv[:q], f"{p}.self_attn.k_proj.weight": qkv[q:q + kv],
                   f"{p}.self_attn.v_proj.weight": qkv[q + kv:]}
        deltas[f"{p}.mlp.gate_proj.weight"] = module(5, layer, 8, h, inter)
        deltas[f"{p}.mlp.down_proj.weight"] = module(6, layer, 5, inter, h)
        deltas[f"{p}.mlp.up_proj.weight"] = module(7, layer, 16, h, inter)
    weights = torch.zeros(len(rows), max(r.numel() for r in rows))
    for i, row in enumerate(rows):
        weights[i, :row.numel()] = row
    order = torch.randperm(len(rows), generator=g)                    # rows may come in any order
    return weights[order].numpy(), np.array(config, dtype=np.int32)[order.numpy()], deltas


@pytest.mark.parametrize("device,kernel_backend", [("cpu", "auto"), pytest.param("cuda", "auto", marks=CUDA_MARKS),
                                                   pytest.param("cpu", "triton", marks=INTERPRETER_MARK)])
def test_hand_built_trtllm_adapter_equals_hf_with_its_deltas_merged(tiny_model_dir, device, kernel_backend):
    from transformers import AutoModelForCausalLM
    engine = LLMEngine(tiny_model_dir, dtype="float32", device=device, kernel_backend=kernel_backend,
                       kv_cache_memory_bytes=1 << 20)      # the Triton kernels keep the fused qkv A once
    weights, config, deltas = hand_built_adapter(engine.model_config)
    engine.add_lora(5, weights, config)
    prompts = random_prompts([6, 21, 13, 30], engine.model_config.vocab_size, seed=16)
    tasks = [5, None, 5, 5]
    outputs = engine.generate(prompts, max_new_tokens=10, lora_task_ids=tasks)

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).to(device).eval()
    merged = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        params = dict(merged.named_parameters())
        for name, delta in deltas.items():
            params[name] += delta
    merged = merged.to(device)
    assert any(hf_greedy(merged, p, 10) != hf_greedy(base, p, 10) for p in prompts), "the adapter changes tokens"
    for prompt, task, out in zip(prompts, tasks, outputs):
        assert out == hf_greedy(merged if task else base, prompt, 10)
