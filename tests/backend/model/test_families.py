"""The base models beyond Llama, each a tiny random config built with transformers' own classes, served token for
token as transformers (the base) and PEFT (adapters of ranks 4-64 on every module, a DoRA one, base rows beside
them) give it in fp32: on every CPU path, at two tensor-parallel ranks, with steps one ahead and through the decode
graphs' padded steps.
The mixtures of experts (8 experts, top 2): adapters on attention, every expert, the router and (Qwen2-MoE) the
shared expert and its gate, in PEFT's two ways onto experts; the same adapter in every form it arrives in.
"""
import re

import numpy as np
import pytest
import torch

from backend import LLMEngine, RequestError
from backend.lora.format import parse_lora
from backend.model.checkpoint import ModelConfig
from backend.model.graphs import DecodeGraphs
from scripts.prepare_model import build_tiny
from tests.helpers import (ALL_MODULES, CPU_BACKENDS, INTERPRETER_MARK, hf_greedy, make_peft_adapters,
                           peft_greedy_alone, peft_model_with, random_prompts)

FAMILIES = ["qwen3", "phi3", "phi4", "gemma2", "gemma3", "qwen3_moe", "qwen2_moe", "mixtral"]   # phi4: Phi-3's kind
PHI = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]         # every module it has      # with RoPE over 3/4 of a
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]                                         # head
MODULES = {"qwen3": ALL_MODULES, "phi3": PHI, "phi4": PHI, "gemma2": ALL_MODULES, "gemma3": ALL_MODULES,
           "qwen3_moe": ATTENTION, "qwen2_moe": ALL_MODULES, "mixtral": ATTENTION}   # (Qwen2-MoE's: its shared expert)
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj", "mlp.gate.weight"]    # every expert, the router
MIXTURES = {   # PEFT's two ways onto the experts: target_parameters, and dense names it moves there (Qwen3-MoE's
    "qwen3_moe": [dict(target_parameters=EXPERTS),                # gate_proj / up_proj / down_proj, Mixtral's w1-w3:
                  dict(target_modules=ATTENTION + ["gate_proj", "up_proj", "down_proj"])],      # gate and up at rank
    "qwen2_moe": [dict(target_parameters=EXPERTS, target_modules=ALL_MODULES + ["shared_expert_gate"]),  # 2r then)
                  dict(target_parameters=EXPERTS)],
    "mixtral": [dict(target_modules=ATTENTION + ["w1", "w2", "w3", "gate"]), dict(target_parameters=EXPERTS)]}
NO_DORA = {"qwen2_moe": ("q_proj", "k_proj", "v_proj")}           # (biased: refused under DoRA)
LORA_DTYPE = {family: "float32" for family in MIXTURES}          # (an expert adapter in fp16 flips a near tie of the
                                                                 # tiny Mixtral's: 1.9484 against 1.9482)
TASKS = [None, 1, 2, 3, 1, None, 3, 2]                 # request i's adapter (None: the base)
LENGTHS = [5, 23, 9, 40, 3, 17, 30, 12]
MAX_NEW = 8
INTERPRETED = 5                                        # requests the interpreter runs: base rows, every adapter, a
                                                       # prompt in chunks
EOS = 2                                                # the tiny models' eos, where transformers stops too
PATHS = CPU_BACKENDS + [pytest.param("triton", marks=INTERPRETER_MARK)]    # the Triton kernels: the interpreter


def specs(family: str) -> list[dict]:
    """Ranks 4, 64 (16 on a mixture's experts: its stacks are [slots x experts, ...]) and a DoRA one."""
    mixture = MIXTURES.get(family)
    first, second = mixture or [{}, {}]
    return [dict(r=4, lora_alpha=8, target_modules=MODULES[family]) | first,
            dict(r=16 if mixture else 64, lora_alpha=32, use_rslora=True, target_modules=MODULES[family]) | second,
            dict(r=16, lora_alpha=16, use_dora=True,
                 target_modules=[m for m in MODULES[family] if m not in NO_DORA.get(family, ())])]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def family_dir(family, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"tiny-{family}")
    build_tiny(path, seed=5, architecture=family)
    return path


@pytest.fixture(scope="module")
def family_adapters(family, family_dir, tmp_path_factory):
    return make_peft_adapters(family_dir, tmp_path_factory.mktemp("adapters"), specs=specs(family), seed=11)


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(LENGTHS, 512, seed=61)


@pytest.fixture(scope="module")
def peft(family_dir, family_adapters):
    """greedy(prompt, task): PEFT's tokens with the task's adapter (None: the base), each adapter in a model of its
    own (PEFT holds adapters of different target_parameters apart, and mixes no DoRA adapter in a batch)."""
    models = [peft_model_with(family_dir, [adapter]) for adapter in family_adapters]
    return lambda prompt, task: peft_greedy_alone(models[(task or 1) - 1], prompt, task and "a0", MAX_NEW)


@pytest.fixture(scope="module")
def expected(peft, prompts):
    return [peft(p, t) for p, t in zip(prompts, TASKS)]


def serve(engine: LLMEngine, adapters, prompts) -> list[list[int]]:
    for task_id, path in enumerate(adapters, start=1):
        engine.add_lora_dir(task_id, path)
    return engine.generate(prompts, max_new_tokens=MAX_NEW, lora_task_ids=TASKS[:len(prompts)], end_id=EOS)


def make_engine(model_dir, kernel_backend: str, **kwargs) -> LLMEngine:
    return LLMEngine(model_dir, dtype="float32", kernel_backend=kernel_backend, kv_cache_memory_bytes=1 << 20,
                     max_num_batched_tokens=32, max_num_seqs=6, **kwargs)


def test_every_adapter_changes_the_tokens(peft, prompts, expected):
    for prompt, task, tokens in zip(prompts, TASKS, expected):
        if task is not None:
            assert tokens != peft(prompt, None), task


@pytest.mark.parametrize("kernel_backend", CPU_BACKENDS)      # (Triton: base rows in the adapters' test)
def test_the_base_matches_transformers(family_dir, prompts, kernel_backend):
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(family_dir, dtype=torch.float32).eval()
    engine = make_engine(family_dir, kernel_backend)
    assert engine.generate(prompts, max_new_tokens=MAX_NEW, end_id=EOS) == [hf_greedy(hf, p, MAX_NEW) for p in prompts]


@pytest.mark.parametrize("kernel_backend", PATHS)
def test_mixed_adapters_match_peft(family, family_dir, family_adapters, prompts, expected, kernel_backend):
    num = INTERPRETED if kernel_backend == "triton" else len(prompts)
    engine = make_engine(family_dir, kernel_backend, lora_dtype=LORA_DTYPE.get(family, "auto"))
    assert serve(engine, family_adapters, prompts[:num]) == expected[:num]


def test_two_ranks_match_peft(family, family_dir, family_adapters, prompts, expected):
    engine = make_engine(family_dir, "torch", tensor_parallel_size=2, lora_dtype=LORA_DTYPE.get(family, "auto"))
    try:
        assert serve(engine, family_adapters, prompts) == expected
    finally:
        engine.close()


def test_steps_one_ahead_match_peft(family, family_dir, family_adapters, prompts, expected):
    """overlap_steps: each step launched before the last one's tokens reach the host (a mixture's routing and its
    adapters' rows from the device's ids)."""
    engine = make_engine(family_dir, "torch", overlap_steps="true", lora_dtype=LORA_DTYPE.get(family, "auto"))
    assert engine.overlap
    assert serve(engine, family_adapters, prompts) == expected


@INTERPRETER_MARK
def test_the_decode_graphs_padded_steps_match_peft(family, family_dir, family_adapters, prompts, expected):
    """Every decode step through the padded fixed buffers a CUDA graph records (run eagerly here)."""
    engine = make_engine(family_dir, "triton", lora_dtype=LORA_DTYPE.get(family, "auto"))
    runner = engine.runner
    runner.graphs = DecodeGraphs(runner.model, runner.kv_caches, engine.lora_cache.slots, 6, runner.block_size,
                                 runner.device, capture=False)
    assert serve(engine, family_adapters, prompts[:INTERPRETED]) == expected[:INTERPRETED]


@pytest.mark.parametrize("kernel_backend", PATHS)
def test_gemma2s_soft_capped_logits_score_a_prompt_as_transformers(tmp_path, kernel_backend):
    """Gemma 2's final logits soft-capped (tanh keeps the greedy token: the log probs show it), its attention
    scores too: a prompt's log probs == transformers' log_softmax at each position."""
    from transformers import AutoModelForCausalLM
    build_tiny(tmp_path, seed=5, architecture="gemma2")
    prompt = random_prompts([37], 512, seed=62)[0]
    with torch.inference_mode():
        hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
        want = hf(input_ids=torch.tensor([prompt])).logits[0].float().log_softmax(-1)
    want = want[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    engine = make_engine(tmp_path, kernel_backend)
    engine.add_request(prompt, max_new_tokens=1, return_prompt_log_probs=True)
    scored = []
    while engine.has_unfinished:                      # (the prompt in two chunks: its log probs with the token)
        scored += [out.prompt_log_probs for out in engine.step() if out.prompt_log_probs is not None]
    [scored] = scored
    torch.testing.assert_close(scored.log_probs[1:], want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("module,says", [(1, "its q, k and v are one, module 0 (attn_qkv)"),
                                         (7, "its gate and up are one, module 5 (mlp_h_to_4h)")])
def test_a_module_phi3_has_not_is_refused_by_name(tmp_path, module, says):
    build_tiny(tmp_path, seed=5, architecture="phi3")
    cfg = ModelConfig.from_dir(tmp_path)
    weights = np.full((1, 4 * (cfg.hidden_size + 2 * cfg.intermediate_size)), 0.01, np.float16)
    with pytest.raises(RequestError, match=f"row 0: module {module} .*Phi3ForCausalLM has no such module; "
                                           + re.escape(says)) as err:
        parse_lora(weights, np.array([[module, 0, 4]], np.int32), cfg, torch.float32, 64, 1 << 30)
    assert err.value.field == "lora_config"


def trtllm_rows(pieces: list[tuple[int, int, torch.Tensor, torch.Tensor]]) -> tuple[np.ndarray, np.ndarray]:
    """TensorRT-LLM lora_weights and lora_config from (module, layer, A [r, in], B [out, r]): A then B flattened,
    rows padded to the widest."""
    return padded([torch.cat([a.flatten(), b.flatten()]) for _, _, a, b in pieces]), \
        np.array([[m, layer, a.shape[0]] for m, layer, a, _ in pieces], np.int32)


def padded(rows: list[torch.Tensor]) -> np.ndarray:
    """lora_weights: the rows one under another, zero-padded to the widest."""
    weights = torch.zeros(len(rows), max(row.numel() for row in rows))
    for i, row in enumerate(rows):
        weights[i, :row.numel()] = row
    return weights.numpy()


@pytest.mark.parametrize("kernel_backend", CPU_BACKENDS)
def test_qwen3_moes_dense_layer_takes_mlp_adapters_as_the_merged_model(tmp_path, kernel_backend):
    """Modules 5-7 on Qwen3-MoE's dense layer (PEFT moves them onto the experts): tokens == transformers with
    W + B A merged into that layer's gate, up and down."""
    from transformers import AutoModelForCausalLM
    build_tiny(tmp_path, seed=5, architecture="qwen3_moe")
    cfg = ModelConfig.from_dir(tmp_path)
    g = torch.Generator().manual_seed(3)
    h, inter = cfg.hidden_size, cfg.intermediate_size
    pieces = [(module, 0, torch.randn(8, fan_in, generator=g) * 0.3, torch.randn(fan_out, 8, generator=g) * 0.3)
              for module, fan_in, fan_out in ((5, h, inter), (7, h, inter), (6, inter, h))]
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    mlp = hf.model.layers[0].mlp
    with torch.no_grad():
        for (module, _, a, b), proj in zip(pieces, (mlp.gate_proj, mlp.up_proj, mlp.down_proj)):
            proj.weight += b @ a
    prompts = random_prompts(LENGTHS[:4], 512, seed=61)
    engine = make_engine(tmp_path, kernel_backend)
    engine.add_lora(1, *trtllm_rows(pieces))
    got = engine.generate(prompts, max_new_tokens=MAX_NEW, lora_task_ids=[1, None, 1, 1], end_id=EOS)
    base = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert got == [hf_greedy(hf if task else base, p, MAX_NEW) for p, task in zip(prompts, [1, None, 1, 1])]
    assert got[0] != hf_greedy(base, prompts[0], MAX_NEW)                   # the adapter changes the tokens


@pytest.mark.parametrize("architecture,row,says", [
    ("qwen3_moe", [5, 1, 4], r"row 0: module 5 \(mlp_h_to_4h\): layer 1 of Qwen3MoeForCausalLM is a mixture of "
                             r"experts with no dense MLP or shared expert \(its experts: modules 13-16\)"),
    ("mixtral", [6, 0, 4], "row 0: module 6 .*layer 0 of MixtralForCausalLM is a mixture of experts"),
    ("qwen3_moe", [13, 0, 4], r"row 0: module 13 \(moe_h_to_4h\): layer 0 of Qwen3MoeForCausalLM is a dense MLP"),
    ("qwen3_moe", [17, 1, 4], r"row 0: module 17 \(mlp_router\): layer 1 of Qwen3MoeForCausalLM has no shared "
                              "expert"),
    ("qwen2_moe", [14, 1, 4, 1], r"row 0: DoRA on module 14 \(moe_4h_to_h\) is not supported"),
    ("qwen3", [16, 0, 4], r"row 0: module 16 \(moe_router\): Qwen3ForCausalLM is not a mixture of experts")])
def test_a_module_the_layer_has_not_is_refused_by_name(tmp_path, architecture, row, says):
    build_tiny(tmp_path, seed=5, architecture=architecture)
    cfg = ModelConfig.from_dir(tmp_path)
    weights = np.full((1, 4 * (cfg.hidden_size + 2 * cfg.intermediate_size)), 0.01, np.float16)
    with pytest.raises(RequestError, match=says) as err:
        parse_lora(weights, np.array([row], np.int32), cfg, torch.float32, 64, 1 << 30)
    assert err.value.field == "lora_config"


def test_a_peft_adapter_for_another_expert_count_is_refused_by_name(tmp_path):
    from dataclasses import replace

    from backend.lora.peft import load_lora_dir
    build_tiny(tmp_path / "base", seed=5, architecture="mixtral")
    [adapter] = make_peft_adapters(tmp_path / "base", tmp_path, specs=[dict(r=4, target_parameters=EXPERTS)])
    other = replace(ModelConfig.from_dir(tmp_path / "base"), num_experts=3)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts(\.base_layer)?: lora_A \[32, \d+\] and "
                                         r"lora_B \[\d+, 32\] are not 3 experts'"):
        load_lora_dir(adapter, model=other)


def trtllm_from_peft(adapter_dir, cfg: ModelConfig) -> tuple[np.ndarray, np.ndarray]:
    """The test's own reading of a PEFT adapter on a mixture (r and lora_alpha alone, no patterns) into TensorRT-LLM
    rows, from the formats' definitions: q_proj is module 1, the router 16, the shared expert's gate 17; PEFT's
    stacked experts (lora_A [experts * r, in], expert e's rows e * r..; lora_B [out, experts * r], expert e's
    columns j * experts + e) are gate 13 and up 15 (gate_up's first and second halves of out, one A) and down 14,
    each row every expert's A [experts, r, in] then every expert's B [experts, out, r]."""
    import json

    from safetensors.torch import load_file
    peft_cfg = json.loads((adapter_dir / "adapter_config.json").read_text())
    scale = peft_cfg["lora_alpha"] / peft_cfg["r"]
    tensors = {k.removeprefix("base_model.model.model."): v.float()
               for k, v in load_file(adapter_dir / "adapter_model.safetensors").items()}
    num, inter = cfg.num_experts, cfg.moe_intermediate_size
    rows, config = [], []
    for layer in range(cfg.num_layers):
        def pair(name):
            return tensors[f"layers.{layer}.{name}.lora_A.weight"], tensors[f"layers.{layer}.{name}.lora_B.weight"]
        for module, name in ((1, "self_attn.q_proj"), (16, "mlp.gate"), (17, "mlp.shared_expert_gate")):
            a, b = pair(name)
            rows.append(torch.cat([a.flatten(), (b * scale).flatten()]))
            config.append([module, layer, a.shape[0]])
        for name in ("mlp.experts.base_layer", "mlp.experts"):
            a, b = pair(name)
            r = a.shape[0] // num
            per_expert_b = torch.stack([b[:, [j * num + e for j in range(r)]] for e in range(num)]) * scale
            parts = ([(13, per_expert_b[:, :inter]), (15, per_expert_b[:, inter:])] if a.shape[1] == cfg.hidden_size
                     else [(14, per_expert_b)])                  # (gate_up reads hidden, down the experts' width)
            for module, b_part in parts:
                rows.append(torch.cat([a.flatten(), b_part.flatten()]))
                config.append([module, layer, r])
    return padded(rows), np.array(config, np.int32)


def per_expert_peft(adapter_dir, out, cfg: ModelConfig):
    """The adapter rewritten in PEFT's older per-expert keys (experts.N.gate_proj / up_proj / down_proj, each its
    own lora_A [r, in] and lora_B [out, r]; gate and up both with the expert's shared A)."""
    import shutil

    from safetensors.torch import load_file, save_file
    out.mkdir()
    shutil.copy(adapter_dir / "adapter_config.json", out)
    num, inter = cfg.num_experts, cfg.moe_intermediate_size
    written = {}
    for key, t in load_file(adapter_dir / "adapter_model.safetensors").items():
        stacked = re.match(r"(.*\.mlp)\.experts(\.base_layer)?\.lora_([AB])\.weight$", key)
        if stacked is None:
            written[key] = t
            continue
        prefix, gate_up, ab = stacked[1], stacked[2] is not None, stacked[3]
        r = t.shape[0 if ab == "A" else 1] // num
        for e in range(num):
            part = t[e * r:(e + 1) * r] if ab == "A" else t[:, [j * num + e for j in range(r)]]
            if not gate_up:
                written[f"{prefix}.experts.{e}.down_proj.lora_{ab}.weight"] = part.contiguous()
                continue
            for proj, rows in (("gate_proj", slice(0, inter)), ("up_proj", slice(inter, 2 * inter))):
                written[f"{prefix}.experts.{e}.{proj}.lora_{ab}.weight"] = (
                    part if ab == "A" else part[rows]).clone()
    save_file(written, out / "adapter_model.safetensors")
    return out


@pytest.mark.parametrize("form", ["trtllm_tensors", "per_expert_keys", "hf_lora_convert"])
def test_an_adapter_on_experts_router_and_shared_gate_in_every_form_matches_peft(tmp_path, form):
    """Qwen2-MoE with LoRA on q, the router, the shared expert's gate and every expert: sent as TensorRT-LLM
    tensors built by the test's own reading of PEFT's files, as PEFT's older per-expert keys, and as the files
    scripts/hf_lora_convert.py writes: the tokens PEFT gives."""
    import subprocess
    import sys

    from backend.lora.peft import load_npy
    from tests.helpers import ROOT
    build_tiny(tmp_path / "base", seed=5, architecture="qwen2_moe")
    cfg = ModelConfig.from_dir(tmp_path / "base")
    [adapter] = make_peft_adapters(tmp_path / "base", tmp_path, seed=17, specs=[dict(
        r=8, lora_alpha=16, target_modules=["q_proj", "shared_expert_gate"], target_parameters=EXPERTS)])
    prompts = random_prompts(LENGTHS[:4], 512, seed=63)
    model = peft_model_with(tmp_path / "base", [adapter])
    want = [peft_greedy_alone(model, p, "a0", MAX_NEW) for p in prompts]
    assert want != [peft_greedy_alone(model, p, None, MAX_NEW) for p in prompts]
    engine = make_engine(tmp_path / "base", "torch", lora_dtype="float32")
    if form == "trtllm_tensors":
        engine.add_lora(1, *trtllm_from_peft(adapter, cfg))
    elif form == "per_expert_keys":
        engine.add_lora_dir(1, per_expert_peft(adapter, tmp_path / "per_expert", cfg))
    else:
        subprocess.run([sys.executable, ROOT / "scripts" / "hf_lora_convert.py", "-i", adapter, "-o",
                        tmp_path / "out", "--storage-type", "float32", "--base-model", tmp_path / "base"],
                       check=True, capture_output=True)
        files = {name: (tmp_path / "out" / name).read_bytes() for name in ("model.lora_weights.npy",
                                                                          "model.lora_config.npy")}
        engine.add_lora(1, load_npy(files, "model.lora_weights.npy")[0], load_npy(files, "model.lora_config.npy")[0])
    assert engine.generate(prompts, max_new_tokens=MAX_NEW, lora_task_ids=[1] * len(prompts), end_id=EOS) == want
