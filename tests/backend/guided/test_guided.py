"""Guided decoding with xgrammar on SmolLM2: the output follows the JSON schema, the regex, the grammar; a guide
that does not compile is refused naming the input."""
import json
import re
import sys

import pytest

from backend import LLMEngine
from backend.core.request import RequestError, SamplingParams
from backend.text import load_tokenizer

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
PROMPT = "<|im_start|>user\nDescribe a person as JSON.<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def engine(smollm2_dir):
    return LLMEngine(smollm2_dir, kv_cache_memory_bytes=64 << 20, guided_decoding_backend="xgrammar")


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    return load_tokenizer(str(smollm2_dir))


def complete(engine, tokenizer, guide_type, guide="", max_new_tokens=48, **sampling) -> str:
    ids = tokenizer(PROMPT)["input_ids"]
    request_id = engine.add_request(ids, SamplingParams(max_new_tokens=max_new_tokens, guide_type=guide_type,
                                                        guide=guide, end_id=tokenizer.eos_token_id, **sampling))
    tokens, reason = [], None
    while engine.has_unfinished:
        for out in engine.step():
            assert out.request_id == request_id and not out.error
            tokens += out.new_token_ids
            reason = out.finish_reason or reason
    assert reason == "stop", "the guide completes before max_new_tokens"
    return tokenizer.decode(tokens, skip_special_tokens=True)


@pytest.mark.parametrize("sampling", [{}, {"temperature": 1.0, "top_k": 50, "seed": 5}])
def test_output_follows_the_json_schema(engine, tokenizer, sampling):
    value = json.loads(complete(engine, tokenizer, "json_schema", json.dumps(SCHEMA), **sampling))
    assert set(value) == {"name", "age"} and isinstance(value["name"], str) and 0 <= value["age"] <= 120


def test_output_follows_the_regex_and_the_grammar(engine, tokenizer):
    assert re.fullmatch(r"[A-Z][a-z]{2,6}-[0-9]{3}", complete(engine, tokenizer, "regex", r"[A-Z][a-z]{2,6}-[0-9]{3}"))
    grammar = 'root ::= "yes" | "no" | "maybe " [0-9]'
    assert re.fullmatch(r"yes|no|maybe [0-9]", complete(engine, tokenizer, "ebnf_grammar", grammar))
    json.loads(complete(engine, tokenizer, "json", max_new_tokens=96))


def test_guided_and_free_requests_share_a_batch(engine, tokenizer):
    ids = tokenizer(PROMPT)["input_ids"]
    free = engine.generate([ids], max_new_tokens=12)[0]
    guided = engine.add_request(ids, SamplingParams(max_new_tokens=8, guide_type="regex", guide="[0-9]{8}"))
    plain = engine.add_request(ids, SamplingParams(max_new_tokens=12))
    outputs = {guided: [], plain: []}
    while engine.has_unfinished:
        for out in engine.step():
            outputs[out.request_id] += out.new_token_ids
    assert outputs[plain] == free and re.fullmatch("[0-9]{8}", tokenizer.decode(outputs[guided]))


def test_a_guide_that_does_not_compile_is_refused(engine):
    with pytest.raises(RequestError, match=r"^guided_decoding_guide: does not compile as json_schema"):
        engine.add_request([1, 2], SamplingParams(guide_type="json_schema", guide="{not json"))
    with pytest.raises(RequestError, match=r"^guided_decoding_guide_type: must be one of json, json_schema"):
        engine.add_request([1, 2], SamplingParams(guide_type="xml", guide="<a/>"))


def test_guided_decoding_off_refuses_a_guide(tiny_model_dir):
    engine = LLMEngine(tiny_model_dir, dtype="float32", kernel_backend="torch", kv_cache_memory_bytes=1 << 20)
    with pytest.raises(RequestError, match="guided_decoding_guide_type: guided decoding is off: set the model"):
        engine.add_request([1, 2], SamplingParams(guide_type="json"))
    no_tokenizer = LLMEngine(tiny_model_dir, dtype="float32", kernel_backend="torch", kv_cache_memory_bytes=1 << 20,
                             guided_decoding_backend="xgrammar")
    with pytest.raises(RequestError, match="guided decoding is off: no tokenizer in"):
        no_tokenizer.add_request([1, 2], SamplingParams(guide_type="json"))


def test_an_engine_without_xgrammar_serves_and_refuses_guides_naming_it(tiny_chat_model_dir, monkeypatch):
    """A machine without xgrammar (a GPU machine's bare PyTorch image) serves; guided requests name what is missing."""
    monkeypatch.setitem(sys.modules, "xgrammar", None)              # its import fails as where it is not installed
    engine = LLMEngine(tiny_chat_model_dir, dtype="float32", kernel_backend="torch", kv_cache_memory_bytes=1 << 20,
                       guided_decoding_backend="xgrammar")
    with pytest.raises(RequestError, match="guided decoding is off: install xgrammar"):
        engine.add_request([1, 2], SamplingParams(guide_type="json"))
    engine.add_request([1, 2], SamplingParams(max_new_tokens=2))
    while engine.has_unfinished:
        engine.step()
