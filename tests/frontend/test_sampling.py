"""OpenAI sampling parameters as the core model's inputs, read back through the core's own parser."""
import json

import numpy as np
import pytest

from backend.core.request import RequestLimits
from backend.serving.protocol import parse_request
from frontend.errors import OpenAIError
from frontend.sampling import ModelInfo, check_supported, core_arrays, log_probs_asked, max_tokens
from frontend.schemas import ChatCompletionRequest, CompletionRequest

LIMITS = RequestLimits(max_input_len=8191)


@pytest.fixture(scope="module")
def info(smollm2_dir):
    return ModelInfo.from_dir(smollm2_dir)


def parsed(info, **body):
    req = CompletionRequest(model="m", prompt="x", **body)
    [row] = parse_request(core_arrays(req, [5, 6, 7], 12, info, log_probs_asked(req, chat=False)), LIMITS)
    return row


def test_defaults_sample_at_temperature_one_until_the_end_token(info):
    row = parsed(info)
    p = row.params
    assert row.prompt_ids == [5, 6, 7] and row.streaming and p.max_new_tokens == 12
    assert not p.greedy and p.temperature == 1.0 and p.top_p == 1.0 and p.top_k == 0
    assert p.end_id == info.end_ids[0] == 2 and p.stop_words == [] and not p.return_log_probs


def test_temperature_zero_is_greedy(info):
    assert parsed(info, temperature=0.0).params.greedy


def test_every_sampling_field_reaches_the_core(info):
    p = parsed(info, temperature=0.7, top_p=0.9, top_k=40, seed=-1, n=3, presence_penalty=0.5,
               frequency_penalty=-0.25, repetition_penalty=1.1, min_tokens=2, logprobs=0,
               logit_bias={"17": 5.0, "3": -100}).params
    assert (p.temperature, p.top_p, p.top_k, p.num_return_sequences) == (pytest.approx(0.7), pytest.approx(0.9), 40, 3)
    assert p.seed == (1 << 64) - 1 and p.min_tokens == 2 and p.return_log_probs
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -0.25, pytest.approx(1.1))
    bias = np.zeros(info.vocab_size, np.float32)
    bias[17], bias[3] = 5.0, -100.0
    np.testing.assert_array_equal(p.embedding_bias, bias)


def test_stop_strings_become_stop_words_and_ignore_eos_drops_the_end_token(info):
    p = parsed(info, stop=["\n\n", "END"], ignore_eos=True).params
    assert p.end_id is None
    assert p.stop_words == [info.tokenizer(s, add_special_tokens=False)["input_ids"] for s in ("\n\n", "END")]


def test_response_formats_become_guides(info):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    p = parsed(info, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}).params
    assert p.guide_type == "json_schema" and json.loads(p.guide) == schema
    assert parsed(info, response_format={"type": "json_object"}).params.guide_type == "json"
    assert parsed(info, response_format={"type": "text"}).params.guide_type is None


def test_output_budgets(info):
    chat = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}])
    assert max_tokens(chat, 100, info, None) == info.max_context - 100
    assert max_tokens(chat.model_copy(update={"max_completion_tokens": 7}), 100, info, None) == 7
    assert max_tokens(CompletionRequest(model="m", prompt="x"), 100, info, 16) == 16
    with pytest.raises(OpenAIError, match="max_tokens"):
        max_tokens(CompletionRequest(model="m", prompt="x", max_tokens=info.max_context), 1, info, 16)
    with pytest.raises(OpenAIError, match="prompt"):
        max_tokens(CompletionRequest(model="m", prompt="x"), info.max_context, info, 16)


def test_log_probs_and_min_p_reach_the_core(info):
    p = parsed(info, logprobs=3, echo=True, min_p=0.25, prompt_logprobs=5).params
    assert p.return_log_probs and p.top_log_probs == 5 and p.return_prompt_log_probs and p.min_p == 0.25
    p = parsed(info, logprobs=2).params
    assert p.return_log_probs and p.top_log_probs == 2 and not p.return_prompt_log_probs
    req = CompletionRequest(model="m", prompt="x", echo=True, max_tokens=0, logprobs=0)
    budget = max_tokens(req, 3, info, 16)
    [row] = parse_request(core_arrays(req, [5, 6, 7], budget, info, log_probs_asked(req, chat=False)), LIMITS)
    assert budget == 0 and row.params.max_new_tokens == 1                    # the prompt scored: one token drawn
    assert row.params.return_prompt_log_probs and row.params.top_log_probs == 0
    assert parsed(info, temperature=0.0, min_p=0.5).params.min_p == 0.0      # greedy: min_p changes nothing


@pytest.mark.parametrize("body, param", [
    ({"best_of": 3}, "best_of"), ({"suffix": "x"}, "suffix"), ({"max_tokens": 0}, "max_tokens"),
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs")])
def test_what_the_engine_lacks_is_refused_by_name(body, param):
    with pytest.raises(OpenAIError) as err:
        check_supported(CompletionRequest(model="m", prompt="x", **body))
    assert err.value.status == 400 and err.value.param == param


@pytest.mark.parametrize("body, param", [({"tools": [{"type": "function"}]}, "tools"), ({"top_logprobs": 3}, "top_logprobs"),
                                         ({"max_tokens": 0}, "max_tokens")])
def test_chat_features_the_engine_lacks_are_refused_by_name(body, param):
    with pytest.raises(OpenAIError) as err:
        check_supported(ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], **body))
    assert err.value.param == param


@pytest.mark.parametrize("body, guide_type", [
    ({"guided_json": {"type": "object"}}, "json_schema"), ({"guided_json": '{"type": "object"}'}, "json_schema"),
    ({"guided_regex": "[a-z]+"}, "regex"), ({"guided_grammar": 'root ::= "a"'}, "ebnf_grammar"),
    ({"structured_outputs": {"json": {"type": "object"}}}, "json_schema"),
    ({"structured_outputs": {"regex": "[0-9]"}}, "regex"), ({"structured_outputs": {"json_object": True}}, "json")])
def test_vllms_guided_fields_reach_the_cores_guided_decoding(info, body, guide_type):
    p = parsed(info, **body).params
    assert p.guide_type == guide_type
    if guide_type == "json_schema":
        assert json.loads(p.guide) == {"type": "object"}


def test_a_guided_choice_is_a_grammar_of_exactly_its_strings(info):
    import xgrammar
    p = parsed(info, guided_choice=['say "yes"', "no"]).params
    assert p.guide_type == "ebnf_grammar"
    grammar = xgrammar.Grammar.from_ebnf(p.guide)
    for text, ok in (('say "yes"', True), ("no", True), ("yes", False), ("nono", False)):
        assert xgrammar.testing._is_grammar_accept_string(grammar, text) == ok, text


@pytest.mark.parametrize("body, param", [
    ({"guided_json": {}, "guided_regex": "a"}, "guided_regex"),
    ({"response_format": {"type": "json_object"}, "guided_choice": ["a"]}, "guided_choice"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"min_tokens": 9, "max_tokens": 4}, "min_tokens")])
def test_fields_that_contradict_each_other_are_refused_by_name(body, param):
    with pytest.raises(OpenAIError) as err:
        check_supported(CompletionRequest(model="m", prompt="x", **body))
    assert err.value.status == 400 and err.value.param == param


@pytest.mark.parametrize("body, field", [
    ({"top_k": 2 ** 40}, "top_k"), ({"min_tokens": 2 ** 31}, "min_tokens"), ({"max_tokens": 2 ** 31}, "max_tokens"),
    ({"chat_template": "{{ 1 }}"}, "chat_template"), ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
    ({"store": True}, "store"), ({"messages": [{"role": "user", "content": "hi", "tool_calls": [{"id": "1"}]}]},
                                 "messages.0.tool_calls")])
def test_ints_past_their_wire_types_and_unknown_fields_are_refused_by_name(body, field):
    from pydantic import ValidationError
    with pytest.raises(ValidationError) as err:
        ChatCompletionRequest(**({"model": "m", "messages": [{"role": "user", "content": "hi"}]} | body))
    assert ".".join(map(str, err.value.errors()[0]["loc"])) == field


def test_continue_final_message_needs_no_generation_prompt():
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "continue_final_message": True}
    with pytest.raises(OpenAIError) as err:
        check_supported(ChatCompletionRequest(**body))
    assert err.value.param == "continue_final_message"
    check_supported(ChatCompletionRequest(**body, add_generation_prompt=False))
