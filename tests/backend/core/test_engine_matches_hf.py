"""Greedy output equals Hugging Face transformers token for token, under in-flight batching pressure."""
import pytest
import torch

from backend import LLMEngine
from tests.helpers import CPU_BACKENDS, hf_greedy, kv_bytes_for_blocks, random_prompts

PROMPT_LENGTHS = [5, 40, 17, 3, 29, 11, 52, 23, 8, 36]
MAX_NEW = 12


def run_staggered(engine: LLMEngine, prompts: list[list[int]], end_id: int, joins_every: int = 2) -> list[list[int]]:
    """Add two requests, then one more every few steps while the others decode; collect every output."""
    outputs: dict[int, list[int]] = {}
    finished: list[int] = []
    pending = list(enumerate(prompts))
    step = 0
    while pending or engine.has_unfinished:
        if pending and (step % joins_every == 0 or not engine.has_unfinished or step < 1):
            for _ in range(2 if step == 0 else 1):
                if pending:
                    i, prompt = pending.pop(0)
                    engine.add_request(prompt, request_id=i, max_new_tokens=MAX_NEW, end_id=end_id)
                    outputs[i] = []
        for out in engine.step():
            assert out.error is None
            outputs[out.request_id] += out.new_token_ids
            if out.finished:
                finished.append(out.request_id)
        step += 1
    assert sorted(finished) == list(range(len(prompts))), "every request finishes exactly once"
    return [outputs[i] for i in range(len(prompts))]


@pytest.mark.parametrize("kernel_backend", CPU_BACKENDS)
@pytest.mark.parametrize("block_size", [4, 16])
def test_staggered_batch_with_preemption_and_chunked_prefill_matches_hf(tiny_model_dir, hf_tiny, block_size,
                                                                        kernel_backend):
    probe = LLMEngine(tiny_model_dir, dtype="float32", kernel_backend="torch", kv_cache_memory_bytes=1 << 20)
    cfg = probe.model_config
    num_blocks = -(-(max(PROMPT_LENGTHS) + MAX_NEW) // block_size) + 3     # room for one long sequence and a bit
    engine = LLMEngine(tiny_model_dir, dtype="float32", kernel_backend=kernel_backend, kv_block_size=block_size,
                       kv_cache_memory_bytes=kv_bytes_for_blocks(num_blocks, block_size, cfg),
                       max_num_batched_tokens=16, max_num_seqs=6)
    prompts = random_prompts(PROMPT_LENGTHS, cfg.vocab_size)
    outputs = run_staggered(engine, prompts, end_id=cfg.eos_token_id)

    assert engine.scheduler.num_preemptions > 0, "the KV pool is small enough to force preemption"
    assert max(PROMPT_LENGTHS) > engine.config.max_num_batched_tokens, "long prompts are chunked"
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    for prompt, out in zip(prompts, outputs):
        assert out == hf_greedy(hf_tiny, prompt, MAX_NEW)


@pytest.mark.parametrize("kernel_backend", CPU_BACKENDS)
def test_qwen2_with_qkv_bias_matches_hf(tiny_qwen2_dir, kernel_backend):
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir, dtype=torch.float32).eval()
    engine = LLMEngine(tiny_qwen2_dir, dtype="float32", kernel_backend=kernel_backend, kv_cache_memory_bytes=1 << 20)
    prompts = random_prompts([7, 19, 30], engine.model_config.vocab_size, seed=3)
    outputs = engine.generate(prompts, max_new_tokens=MAX_NEW, end_id=engine.model_config.eos_token_id)
    assert outputs == [hf_greedy(hf, p, MAX_NEW) for p in prompts]


@pytest.mark.slow
@pytest.mark.parametrize("kernel_backend", CPU_BACKENDS)
def test_smollm2_matches_hf(smollm2_dir, hf_smollm2, kernel_backend):
    engine = LLMEngine(smollm2_dir, dtype="float32", kernel_backend=kernel_backend, kv_cache_memory_bytes=64 << 20,
                       max_num_batched_tokens=32)
    prompts = random_prompts([6, 45, 21], engine.model_config.vocab_size, seed=7)
    outputs = engine.generate(prompts, max_new_tokens=16, end_id=engine.model_config.eos_token_id)
    assert outputs == [hf_greedy(hf_smollm2, p, 16) for p in prompts]


@pytest.mark.slow
def test_smollm2_answers_a_chat_prompt_coherently(smollm2_dir):
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    engine = LLMEngine(smollm2_dir, dtype="bfloat16", kernel_backend="torch", kv_cache_memory_bytes=64 << 20)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    prompt = prompt["input_ids"] if isinstance(prompt, dict) or hasattr(prompt, "keys") else prompt
    [out] = engine.generate([prompt], max_new_tokens=24, end_id=tokenizer.eos_token_id)
    assert "Paris" in tokenizer.decode(out, skip_special_tokens=True)
