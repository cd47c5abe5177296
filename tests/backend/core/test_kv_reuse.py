"""KV cache reuse (enable_kv_cache_reuse): shared prompt prefixes are computed once, per adapter, and every
output equals the one computed without reuse (Hugging Face for the base, the engine without reuse for LoRA)."""

from backend import LLMEngine
from backend.core.request import SamplingParams
from tests.helpers import hf_greedy, kv_bytes_for_blocks, random_prompts

SYSTEM = random_prompts([37], 512, seed=90)[0]                    # a shared system prompt: 9 full blocks of 4
QUESTIONS = random_prompts([3, 6, 9, 5], 512, seed=91)
MAX_NEW = 6


def engine(tiny_model_dir, reuse: bool, num_blocks: int = 200, **kwargs) -> LLMEngine:
    probe = LLMEngine(tiny_model_dir, dtype="float32", kernel_backend="torch", kv_cache_memory_bytes=1 << 20)
    return LLMEngine(tiny_model_dir, dtype="float32", kernel_backend="torch", kv_block_size=4,
                     kv_cache_memory_bytes=kv_bytes_for_blocks(num_blocks, 4, probe.model_config),
                     enable_kv_cache_reuse=reuse, **kwargs)


def run_one(engine, prompt, task_id=None):
    """(tokens, blocks reused) of one request run alone."""
    request_id = engine.add_request(prompt, SamplingParams(max_new_tokens=MAX_NEW), lora=task_id)
    first = engine.seqs[request_id][0]
    tokens = []
    while engine.has_unfinished:
        tokens += [t for out in engine.step() for t in out.new_token_ids]
    return tokens, first.metrics.num_reused_blocks


def test_a_shared_system_prompt_is_computed_once_and_changes_no_token(tiny_model_dir, hf_tiny):
    e = engine(tiny_model_dir, reuse=True)
    results = [run_one(e, SYSTEM + q) for q in QUESTIONS]
    assert [tokens for tokens, _ in results] == [hf_greedy(hf_tiny, SYSTEM + q, MAX_NEW) for q in QUESTIONS]
    assert [reused for _, reused in results] == [0, 9, 9, 9]
    assert (e.blocks.num_hits, e.blocks.num_used_blocks) == (27, 0)
    again, reused = run_one(e, SYSTEM + QUESTIONS[1])               # its own blocks too: prompt and output
    assert again == results[1][0] and reused == (len(SYSTEM) + len(QUESTIONS[1]) - 1) // 4


def test_an_adapters_blocks_never_serve_another_adapter_or_the_base(tiny_model_dir, tiny_adapters):
    with_reuse, without = engine(tiny_model_dir, reuse=True), engine(tiny_model_dir, reuse=False)
    for e in (with_reuse, without):
        e.add_lora_dir(1, tiny_adapters[0])
        e.add_lora_dir(2, tiny_adapters[2])
    order = [(1, 0), (None, 1), (2, 2), (1, 3), (None, 0), (2, 1)]
    got = [run_one(with_reuse, SYSTEM + QUESTIONS[q], task) for task, q in order]
    want = [run_one(without, SYSTEM + QUESTIONS[q], task)[0] for task, q in order]
    assert [tokens for tokens, _ in got] == want
    assert [reused for _, reused in got] == [0, 0, 0, 9, 9, 9]        # each adapter's first request computes


def test_eviction_and_preemption_stay_exact_with_reuse(tiny_model_dir, hf_tiny):
    """A pool too small for the batch: named blocks are evicted, sequences preempted and recomputed."""
    e = engine(tiny_model_dir, reuse=True, num_blocks=24, max_num_batched_tokens=16, max_num_seqs=6)
    prompts = [SYSTEM[:20] + q for q in QUESTIONS] + random_prompts([30, 11], 512, seed=92)
    outputs = e.generate(prompts, max_new_tokens=MAX_NEW)
    assert e.scheduler.num_preemptions > 0 and e.blocks.num_hits > 0
    assert outputs == [hf_greedy(hf_tiny, p, MAX_NEW) for p in prompts]
    assert e.blocks.num_free_blocks == e.blocks.num_blocks


def test_an_adapter_sent_again_after_eviction_gets_new_block_names(tiny_model_dir, tiny_adapters):
    e = engine(tiny_model_dir, reuse=True)
    e.add_lora_dir(5, tiny_adapters[0])
    before = e.lora_cache.key(5)
    run_one(e, SYSTEM + QUESTIONS[0], 5)                             # names its blocks
    e.lora_cache._evict_host(5)
    e.add_lora_dir(5, tiny_adapters[1])                             # other weights under the same task id
    assert e.lora_cache.key(5) != before
    assert [run_one(e, SYSTEM + QUESTIONS[0], 5)[1] for _ in range(2)] == [0, 9]
