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
    (dict(prompt_ids=[5], beam_width=9), "beam_width", "9 is outside [1, 8] (the model's max_beam_width 8)"),
    (dict(prompt_ids=[5], beam_width=0), "beam_width", "outside [1, 8]"),
    (dict(prompt_ids=[5], beam_width=2, num_return_sequences=3), "num_return_sequences", "[1, beam_width 2]"),
    (dict(prompt_ids=[5], beam_width=2, top_log_probs=2), "num_top_log_probs", "not supported with beam search"),
    (dict(prompt_ids=[5], beam_width=2, length_penalty=float("nan")), "len_penalty", "finite"),
    (dict(prompt_ids=[5], beam_width=2, early_stopping="sometimes"), "early_stopping", "true, false or"),
    (dict(prompt_ids=[5], temperature=-1.0), "temperature", ">= 0"),
    (dict(prompt_ids=[5], top_p=1.5), "runtime_top_p", "(0, 1]"),
    (dict(prompt_ids=[5], end_id=99999), "end_id", "outside the vocabulary"),
    (dict(prompt_ids=[5], stop_words=[[1, 70000]]), "stop_words_list", "outside"),
    (dict(prompt_ids=[5] * 600), "input_ids", "600 tokens exceed the model's max input length 511"),
    (dict(prompt_ids=[5], temperature=float("nan"), top_k=5), "temperature", "finite"),
    (dict(prompt_ids=[5], top_p=float("nan")), "runtime_top_p", "finite"),
    (dict(prompt_ids=[5], repetition_penalty=float("nan")), "repetition_penalty", "finite"),
    (dict(prompt_ids=[5], presence_penalty=float("inf")), "presence_penalty", "finite"),
    (dict(prompt_ids=[5], frequency_penalty=float("-inf")), "frequency_penalty", "finite"),
    (dict(prompt_ids=[5], bad_words=[[7]] * 1025), "bad_words_list", "1025 words exceed max_words 1024"),
    (dict(prompt_ids=[5], stop_words=[[7] * 65]), "stop_words_list", "65 tokens exceeds max_word_len 64"),
]


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return LLMEngine(tiny_model_dir, dtype="float32", kernel_backend="torch", kv_cache_memory_bytes=1 << 20)


@pytest.mark.parametrize("kwargs,field,text", BAD_REQUESTS, ids=[b[1] + "-" + b[2][:12] for b in BAD_REQUESTS])
def test_bad_request_is_refused_and_the_engine_keeps_serving(engine, kwargs, field, text):
    good_prompt = random_prompts([9], engine.model_config.vocab_size)[0]
    running = engine.add_request(good_prompt, max_new_tokens=6)
    produced = sum(len(out.new_token_ids) for out in engine.step() if out.request_id == running)
    kwargs = dict(kwargs)
    with pytest.raises(RequestError) as err:
        engine.add_request(kwargs.pop("prompt_ids"), **kwargs)
    assert err.value.field == field and text in err.value.message
    while engine.has_unfinished:
        produced += sum(len(out.new_token_ids) for out in engine.step() if out.request_id == running)
    assert produced == 6
    assert engine.generate([good_prompt], max_new_tokens=3) != [[]]


def test_request_larger_than_the_kv_pool_is_refused(tiny_model_dir):
    engine = LLMEngine(tiny_model_dir, dtype="float32", kernel_backend="torch", kv_block_size=4,
                       kv_cache_memory_bytes=8 * 2 * 2 * 4 * 2 * 16 * 4)   # 8 blocks of 4 tokens
    with pytest.raises(RequestError, match="need 9 KV blocks, the cache holds 8"):
        engine.add_request([5] * 30, max_new_tokens=6)


def test_a_full_queue_is_a_retryable_error_and_frees_nothing(tiny_model_dir):
    engine = LLMEngine(tiny_model_dir, dtype="float32", kernel_backend="torch", kv_cache_memory_bytes=1 << 20,
                       max_queue_size=2)
    first, second = engine.add_request([5, 6], max_new_tokens=2), engine.add_request([7, 8], max_new_tokens=2)
    with pytest.raises(RequestError, match=r"queue full \(2 requests waiting\): retry later"):
        engine.add_request([9], max_new_tokens=2)
    engine.step()                                   # both start: the queue has room again
    engine.add_request([9], max_new_tokens=2)
    while engine.has_unfinished:
        engine.step()
    assert engine.blocks.num_used_blocks == 0 and {first, second}.isdisjoint(engine.seqs)


def test_oversized_inputs_are_refused_from_their_shape_before_they_are_read():
    """A 50M-id prompt or words list is refused by its shape (no list of 50M ints is ever built)."""
    import numpy as np

    from backend.serving.protocol import parse_request
    from backend.core.request import RequestLimits
    limits = RequestLimits(max_input_len=511)
    huge = np.zeros((1, 50_000_000), dtype=np.int32)
    base = {"input_ids": np.zeros((1, 4), dtype=np.int32), "request_output_len": np.array([[4]], dtype=np.int32)}
    with pytest.raises(RequestError, match="input_ids: 50000000 tokens exceed the model's max input length 511"):
        parse_request(base | {"input_ids": huge}, limits)
    words = np.zeros((1, 2, 50_000_000), dtype=np.int32)
    with pytest.raises(RequestError, match="bad_words_list: 50000000 ids exceed max_words 1024 x max_word_len 64"):
        parse_request(base | {"bad_words_list": words}, limits)
    with pytest.raises(RequestError, match="temperature: must be a finite number, got nan"):
        parse_request(base | {"temperature": np.array([[np.nan]], dtype=np.float32)}, limits)
