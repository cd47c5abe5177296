"""Bad input is refused with an error naming the field and the limit; the engine keeps serving."""
import pytest

from backend import LLMEngine, RequestError
from tests.helpers import random_prompts

BAD_REQUESTS = [
    (dict(prompt_ids=[]), "input_ids", "empty"),
    (dict(prompt_ids=[5, 2**31 - 1]), "input_ids", "outside the vocabulary [0, 512)"),
    (dict(prompt_ids=[5, -1]), "input_ids", "outside the vocabulary"),
    (dict(prompt_ids=[5] * 500, max_new_tokens=20), "request_output_len", "max_position_embeddings 512"),
    (dict(prompt_ids=[5], max_new_tokens=0), "request_output_len", "must be > 0"),
    (dict(prompt_ids=[5], max_new_tokens=-3), "request_output_len", "must be > 0"),
    (dict(prompt_ids=[5], beam_width=4), "beam_width", "only beam_width 1"),
    (dict(prompt_ids=[5], temperature=-1.0), "temperature", ">= 0"),
    (dict(prompt_ids=[5], top_p=1.5), "runtime_top_p", "(0, 1]"),
    (dict(prompt_ids=[5], end_id=99999), "end_id", "outside the vocabulary"),
    (dict(prompt_ids=[5], stop_words=[[1, 70000]]), "stop_words_list", "outside"),
]


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return LLMEngine(tiny_model_dir, dtype="float32", kernel_backend="torch", kv_cache_memory_bytes=1 << 20)


@pytest.mark.parametrize("kwargs,field,text", BAD_REQUESTS, ids=[b[1] + "-" + b[2][:12] for b in BAD_REQUESTS])
def test_bad_request_is_refused_and_the_engine_keeps_serving(engine, kwargs, field, text):
    good_prompt = random_prompts([9], engine.model_config.vocab_size)[0]
    running = engine.add_request(good_prompt, max_new_tokens=6)
    engine.step()
    kwargs = dict(kwargs)
    with pytest.raises(RequestError) as err:
        engine.add_request(kwargs.pop("prompt_ids"), **kwargs)
    assert err.value.field == field and text in err.value.message
    produced = 1
    while engine.has_unfinished:
        produced += sum(len(out.new_token_ids) for out in engine.step() if out.request_id == running)
    assert produced == 6
    assert engine.generate([good_prompt], max_new_tokens=3) != [[]]


def test_request_larger_than_the_kv_pool_is_refused(tiny_model_dir):
    engine = LLMEngine(tiny_model_dir, dtype="float32", kernel_backend="torch", kv_block_size=4,
                       kv_cache_memory_bytes=8 * 2 * 2 * 4 * 2 * 16 * 4)   # 8 blocks of 4 tokens
    with pytest.raises(RequestError, match="need 9 KV blocks, the cache holds 8"):
        engine.add_request([5] * 30, max_new_tokens=6)
