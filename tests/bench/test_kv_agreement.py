"""bench/kv_agreement.py: its pieces on the tiny model. The log probs a cache gives an answer's tokens read as a
prompt equal those it gave them as it decoded (fp32), and decode speed counts the decode steps."""
from backend import LLMEngine
from bench.kv_agreement import answers, decode_tok_s, scored
from tests.helpers import random_prompts


def test_an_answer_scored_as_a_prompt_gets_the_log_probs_it_was_decoded_with(tiny_model_dir):
    engine = LLMEngine(tiny_model_dir, dtype="float32", kernel_backend="torch", kv_cache_memory_bytes=1 << 20)
    prompts = random_prompts([5, 17, 9], 512, seed=11)
    tokens, log_probs = answers(engine, prompts, 8)
    assert [len(t) for t in tokens] == [8, 8, 8] and [len(lp) for lp in log_probs] == [8, 8, 8]
    again = scored(engine, prompts, tokens)
    assert all(abs(x - y) < 1e-4 for a, b in zip(log_probs, again) for x, y in zip(a, b))
    assert decode_tok_s(engine, prompts[1], num_tokens=6) > 0
