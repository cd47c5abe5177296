"""Each base model family beyond Llama served for real: a tiny random model of the family (fp32, SmolLM2's tokenizer
beside it) in tritonserver (CPU), an adapter (on a mixture's experts and router too) through the TensorRT-LLM
contract and by name through the OpenAI API, each answering the in-process engine's tokens (which
tests/backend/model/test_families.py holds against PEFT)."""
import shutil

import numpy as np
import openai
import pytest

from backend import LLMEngine
from backend.lora.peft import peft_to_trtllm
from backend.model.checkpoint import ModelConfig
from scripts.prepare_model import build_tiny
from tests.backend.model.test_families import FAMILIES, MIXTURES, MODULES
from tests.helpers import make_peft_adapters, random_prompts
from tests.server.conftest import TINY_ENV, run_frontend, run_server
from tests.server.streams import run, trtllm_inputs

MAX_NEW = 10
EOS = 2                                               # the tiny models' and SmolLM2's tokenizer's


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory, smollm2_dir):
    """(model dir, a PEFT adapter on it, its TensorRT-LLM tensors in fp16 as clients send them)."""
    path = tmp_path_factory.mktemp(f"served-{request.param}")
    build_tiny(path, seed=5, architecture=request.param)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_dir / name, path / name)
    [adapter] = make_peft_adapters(path, tmp_path_factory.mktemp("adapter"), seed=13,
                                   specs=[dict(r=16, lora_alpha=32, target_modules=MODULES[request.param])
                                          | MIXTURES.get(request.param, [{}])[0]])
    return path, adapter, peft_to_trtllm(adapter, "float16", model=ModelConfig.from_dir(path))


@pytest.fixture(scope="module")
def server(family, tmp_path_factory):
    env = TINY_ENV | {"LORA_LLM_MODEL_DIR": str(family[0])}
    yield from run_server(tmp_path_factory, "family-server", env, models=["lora_llm"])


@pytest.fixture(scope="module")
def frontend(family, server, tmp_path_factory):
    path, adapter, _ = family
    store = tmp_path_factory.mktemp("store")
    shutil.copytree(adapter, store / "tuned")
    yield from run_frontend(tmp_path_factory, server, path, "--adapter-store", str(store))


@pytest.fixture(scope="module")
def expected(family) -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
    """The prompts, and the in-process engine's greedy tokens for them with the adapter and without."""
    path, _, (weights, config) = family
    engine = LLMEngine(path, dtype="float32", kernel_backend="torch", kv_cache_memory_bytes=4 << 20)
    engine.add_lora(7, weights, config)
    prompts = random_prompts([9, 31], 512, seed=81)
    return prompts, engine.generate(prompts, max_new_tokens=MAX_NEW, lora_task_ids=[7, 7], end_id=EOS), \
        engine.generate(prompts, max_new_tokens=MAX_NEW, end_id=EOS)


def test_the_trtllm_contract_serves_the_family_with_an_adapter(family, server, expected):
    _, _, (weights, config) = family
    prompts, with_adapter, base = expected
    assert with_adapter != base
    sent = {"lora_weights": weights[None], "lora_config": config[None]}
    for prompt, tokens, carry in zip(prompts, with_adapter, (sent, {})):          # the weights once, then the id
        result = run(server.grpc_url, trtllm_inputs(prompt, MAX_NEW, True, end_id=np.array([[EOS]], np.int32),
                                                    lora_task_id=np.array([[7]], np.uint64), **carry))
        assert result.error is None, result.error
        assert result.tokens == tokens


def test_the_openai_api_serves_the_family_with_an_adapter_by_name(family, frontend, expected):
    from transformers import AutoTokenizer
    path = family[0]
    client = openai.OpenAI(base_url=frontend.url + "/v1", api_key="none", max_retries=0)
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts, with_adapter, base = expected
    for model, want in (("tuned", with_adapter), (path.name, base)):
        response = client.completions.create(model=model, prompt=prompts, max_tokens=MAX_NEW, temperature=0)
        assert [choice.text for choice in response.choices] == [    # (a character cut at the end is held back)
            tokenizer.decode(tokens, skip_special_tokens=True).rstrip("\ufffd") for tokens in want], model


def test_a_mixtures_bad_expert_rows_are_refused_alone(family, server, expected):
    """Expert rows of the wrong size (the row a smaller expert count would send), refused naming the module, its
    layer and the size; the next request is served."""
    path, _, _ = family
    cfg = ModelConfig.from_dir(path)
    if not cfg.num_experts:
        pytest.skip("a dense family: tests/server/test_bad_inputs.py refuses expert modules on a dense model")
    short = np.zeros((1, 1, 4 * (cfg.num_experts - 1) * (cfg.hidden_size + cfg.moe_intermediate_size)), np.float16)
    prompts, _, base = expected
    result = run(server.grpc_url, trtllm_inputs(prompts[0], MAX_NEW, True, end_id=np.array([[EOS]], np.int32),
                                                lora_task_id=np.array([[77]], np.uint64), lora_weights=short,
                                                lora_config=np.array([[[13, 1, 4]]], np.int32)))
    assert result.error is not None and "lora_weights" in result.error
    assert f"module 13 (moe_h_to_4h) rank 4 on layer 1 ({cfg.num_experts} experts x rank 4" in result.error
    served = run(server.grpc_url, trtllm_inputs(prompts[0], MAX_NEW, True, end_id=np.array([[EOS]], np.int32)))
    assert served.error is None and served.tokens == base[0]
