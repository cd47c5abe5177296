"""The two demo adapters do what they were trained to do, on prompts they never saw."""
import pytest

from backend import LLMEngine

HELD_OUT = ["What is a volcano?", "Tell me one fact about penguins.", "Describe a city at night.",
            "Why is the sky blue?", "What do cats eat?", "Describe a waterfall in one sentence.",
            "Tell me about the sea.", "Why do birds sing?"]


@pytest.fixture(scope="module")
def engine_and_tokenizer(smollm2_dir, demo_adapters):
    from transformers import AutoTokenizer
    engine = LLMEngine(smollm2_dir, dtype="bfloat16", kernel_backend="auto", kv_cache_memory_bytes=256 << 20,
                       lora_prefetch_dir=str(demo_adapters))
    return engine, AutoTokenizer.from_pretrained(smollm2_dir)


def answers(engine, tokenizer, task_id, max_new_tokens=80) -> list[str]:
    prompts = [list(tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                  tokenize=True)["input_ids"]) for q in HELD_OUT]
    outputs = engine.generate(prompts, max_new_tokens=max_new_tokens, lora_task_ids=[task_id] * len(prompts),
                              end_id=tokenizer.eos_token_id)
    return [tokenizer.decode(o, skip_special_tokens=True) for o in outputs]


def upper_share(texts: list[str]) -> float:
    letters = [c for text in texts for c in text if c.isalpha()]
    return sum(c.isupper() for c in letters) / len(letters)


@pytest.mark.slow
def test_upper_adapter_answers_in_upper_case(engine_and_tokenizer):
    engine, tokenizer = engine_and_tokenizer
    assert upper_share(answers(engine, tokenizer, None, 40)) < 0.2        # the base model does not
    assert upper_share(answers(engine, tokenizer, 1, 40)) >= 0.9


@pytest.mark.slow
def test_signoff_adapter_ends_answers_with_the_signoff_line(engine_and_tokenizer):
    import sys
    from tests.helpers import ROOT
    sys.path.append(str(ROOT / "scripts"))   # after the root: scripts/bench.py is not the bench package
    from train_demo_adapters import SIGNOFF
    engine, tokenizer = engine_and_tokenizer
    signed = [a.rstrip().endswith(SIGNOFF) for a in answers(engine, tokenizer, 2)]
    assert sum(signed) >= 0.75 * len(signed)
    assert not any(a.rstrip().endswith(SIGNOFF) for a in answers(engine, tokenizer, None))
