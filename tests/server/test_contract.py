"""TensorRT-LLM's tensorrt_llm contract through a real tritonserver, against the in-process engine: every input
and output its config declares, the sampling inputs as TensorRT-LLM defines them, batches of rows, several
return sequences, perf metrics."""
import re

import numpy as np
import pytest

from backend.serving.contract import UNSUPPORTED
from tests.backend.serving.test_contract import NON_NEUTRAL, neutral
from tests.helpers import ROOT, random_prompts
from tests.server.streams import Stream, run, trtllm_inputs

# tensorrtllm_backend's all_models/inflight_batcher_llm/tensorrt_llm/config.pbtxt (and the names its C++ model reads)
TRTLLM_INPUTS = """input_ids input_lengths request_output_len draft_input_ids decoder_input_ids decoder_input_lengths
draft_logits draft_acceptance_threshold end_id pad_id stop_words_list bad_words_list embedding_bias beam_width
temperature runtime_top_k runtime_top_p runtime_top_p_min runtime_top_p_decay runtime_top_p_reset_ids len_penalty
early_stopping repetition_penalty min_length beam_search_diversity_rate presence_penalty frequency_penalty random_seed
return_log_probs return_context_logits return_generation_logits return_perf_metrics return_kv_cache_reuse_stats
exclude_input_in_output stop streaming prompt_embedding_table prompt_table_extra_ids prompt_vocab_size
num_return_sequences lora_task_id lora_weights lora_config guided_decoding_guide_type guided_decoding_guide
retention_token_range_starts retention_token_range_ends retention_token_range_priorities
retention_token_range_durations_ms retention_decode_priority retention_decode_duration_ms lookahead_window_size
lookahead_ngram_size lookahead_verification_set_size mrope_rotary_cos_sin mrope_position_deltas
encoder_input_features encoder_output_lengths cross_attention_mask skip_cross_attn_blocks context_phase_params
return_num_input_tokens return_num_output_tokens""".split()
TRTLLM_OUTPUTS = """output_ids sequence_length cum_log_probs output_log_probs context_logits generation_logits
batch_index sequence_index context_phase_params kv_cache_alloc_new_blocks kv_cache_reused_blocks
kv_cache_alloc_total_blocks arrival_time_ns first_scheduled_time_ns first_token_time_ns last_token_time_ns
acceptance_rate total_accepted_draft_tokens total_draft_tokens num_input_tokens num_output_tokens""".split()
NUMPY_TYPES = {"TYPE_INT32": np.int32, "TYPE_INT64": np.int64, "TYPE_UINT64": np.uint64, "TYPE_UINT8": np.uint8,
               "TYPE_FP32": np.float32, "TYPE_FP16": np.float16, "TYPE_BOOL": np.bool_, "TYPE_STRING": np.object_}
MAX_NEW = 6


def declared(section: str) -> dict[str, tuple[str, int, bool]]:
    """name -> (data type, number of dims, one value per row) of the config's inputs or outputs."""
    text = (ROOT / "model_repository/lora_llm/config.pbtxt").read_text()
    body = text.split(f"{section} [", 1)[1].split("\n]", 1)[0]
    out = {}
    for line in body.splitlines()[1:]:                     # after "input [" / "output ["
        name, kind, dims = re.search(r'name: "(\w+)" data_type: (\w+) dims: \[ ([^\]]*) \]', line).groups()
        out[name] = (kind, len(dims.split(",")), dims.strip() == "1")
    return out


def typed(name: str, value: np.ndarray) -> np.ndarray | None:
    """value as the config declares the input; empty: an empty tensor of its rank, or None (absent) for an input
    of one value per row."""
    kind, num_dims, one_value = declared("input")[name]
    value = np.asarray(value)
    if value.size == 0:
        if one_value:
            return None
        value = np.zeros((1,) + (0,) * num_dims)
    return value.astype(NUMPY_TYPES[kind])


def test_the_config_declares_every_input_and_output_of_tensorrt_llm():
    assert set(TRTLLM_INPUTS) <= set(declared("input")) and set(TRTLLM_OUTPUTS) <= set(declared("output"))


@pytest.fixture(scope="module")
def engine(new_tiny_engine):
    return new_tiny_engine()


def one(engine, prompt, **params) -> list[int]:
    return engine.generate([prompt], **params)[0]


@pytest.mark.parametrize("name", sorted(UNSUPPORTED))
def test_each_input_of_a_feature_we_lack_through_the_server(tiny_server, name):
    prompt = [5, 6, 7]
    value = typed(name, neutral(name))
    ok = run(tiny_server.grpc_url, trtllm_inputs(prompt, 2, True, **({} if value is None else {name: value})))
    assert ok.error is None and len(ok.tokens) == 2
    refused = run(tiny_server.grpc_url, trtllm_inputs(prompt, 2, True, **{name: typed(name, NON_NEUTRAL[name])}))
    assert refused.error and f"{name}: " in refused.error and "is not supported by this server" in refused.error


def test_sampling_inputs_behave_as_tensorrt_llm_defines_them(tiny_server, engine):
    url, (prompt,) = tiny_server.grpc_url, random_prompts([9], 512, seed=60)
    greedy = one(engine, prompt, max_new_tokens=MAX_NEW)
    hot = run(url, trtllm_inputs(prompt, MAX_NEW, True, temperature=np.array([[2.0]], np.float32)))
    assert hot.tokens == greedy                                   # temperature alone: still greedy
    seeded = dict(runtime_top_k=np.array([[20]], np.int32), temperature=np.array([[1.0]], np.float32),
                  random_seed=np.array([[1234]], np.uint64))
    first, again = (run(url, trtllm_inputs(prompt, MAX_NEW, True, **seeded)).tokens for _ in range(2))
    assert first == again == one(engine, prompt, max_new_tokens=MAX_NEW, top_k=20, temperature=1.0, seed=1234)
    words = np.array([[[greedy[3], greedy[1], -1], [1, 2, -1]]], np.int32)        # two stop words
    stopped = run(url, trtllm_inputs(prompt, MAX_NEW, True, stop_words_list=words)).tokens
    assert stopped == greedy[:2]                                   # stops on whichever comes first
    banned = run(url, trtllm_inputs(prompt, MAX_NEW, True, bad_words_list=np.array([[[greedy[0]], [1]]], np.int32)))
    assert banned.tokens == one(engine, prompt, max_new_tokens=MAX_NEW, bad_words=[[greedy[0]]])
    ended = run(url, trtllm_inputs(prompt, MAX_NEW, True, end_id=np.array([[greedy[2]]], np.int32)))
    assert ended.tokens == greedy[:3]
    longer = run(url, trtllm_inputs(prompt, MAX_NEW, True, end_id=np.array([[greedy[0]]], np.int32),
                                    min_length=np.array([[2]], np.int32)))
    assert longer.tokens == one(engine, prompt, max_new_tokens=MAX_NEW, end_id=greedy[0], min_tokens=2)


def test_log_probs_sum_to_the_cumulative_one_and_sequence_length_counts_the_tokens(tiny_server):
    inputs = trtllm_inputs([5, 6, 7, 8], MAX_NEW, False, return_log_probs=np.array([[True]]),
                           exclude_input_in_output=np.array([[True]]))
    stream = Stream(tiny_server.grpc_url).send(inputs)
    [result] = stream.results()
    stream.close()
    log_probs = result.as_numpy("output_log_probs")
    assert log_probs.shape == (1, 1, MAX_NEW) and (log_probs < 0).all()
    assert result.as_numpy("cum_log_probs")[0, 0] == pytest.approx(log_probs.sum(), rel=1e-5)
    assert result.as_numpy("sequence_length").tolist() == [[MAX_NEW]]


def test_a_batch_of_rows_answers_each_row_with_its_batch_index(tiny_server, engine):
    prompts = random_prompts([5, 9], 512, seed=61)
    arrays = {"input_ids": np.array([prompts[0] + [0] * 4, prompts[1]], np.int32),
              "input_lengths": np.array([[5], [9]], np.int32), "request_output_len": np.array([[3], [5]], np.int32),
              "streaming": np.array([[True], [True]])}
    stream = Stream(tiny_server.grpc_url).send(arrays)
    tokens = {0: [], 1: []}
    for result in stream.results():
        if result.as_numpy("output_ids") is not None:
            tokens[int(result.as_numpy("batch_index")[0, 0])] += result.as_numpy("output_ids").reshape(-1).tolist()
    stream.close()
    assert tokens == {0: one(engine, prompts[0], max_new_tokens=3), 1: one(engine, prompts[1], max_new_tokens=5)}


def test_return_sequences_stream_with_their_sequence_index(tiny_server, engine):
    prompt = random_prompts([10], 512, seed=62)[0]
    sampled = dict(runtime_top_k=np.array([[20]], np.int32), temperature=np.array([[1.0]], np.float32),
                   random_seed=np.array([[99]], np.uint64))
    stream = Stream(tiny_server.grpc_url).send(trtllm_inputs(prompt, MAX_NEW, True, **sampled,
                                                             num_return_sequences=np.array([[3]], np.int32)))
    tokens = {0: [], 1: [], 2: []}
    for result in stream.results():
        if result.as_numpy("output_ids") is not None:
            tokens[int(result.as_numpy("sequence_index")[0, 0])] += result.as_numpy("output_ids").reshape(-1).tolist()
    stream.close()
    want = {i: one(engine, prompt, max_new_tokens=MAX_NEW, top_k=20, temperature=1.0, seed=99 + (i << 32))
            for i in range(3)}
    assert tokens == want


@pytest.mark.parametrize("streaming", [True, False])
def test_generation_logits_come_with_each_token(tiny_server, engine, streaming):
    prompt = random_prompts([7], 512, seed=63)[0]
    stream = Stream(tiny_server.grpc_url).send(trtllm_inputs(prompt, MAX_NEW, streaming,
                                                             return_generation_logits=np.array([[True]]),
                                                             exclude_input_in_output=np.array([[True]])))
    results = [r for r in stream.results() if r.as_numpy("output_ids") is not None]
    stream.close()
    logits = np.concatenate([r.as_numpy("generation_logits") for r in results], axis=2)
    tokens = [t for r in results for t in r.as_numpy("output_ids").reshape(-1).tolist()]
    assert logits.shape == (1, 1, MAX_NEW, 512) and tokens == one(engine, prompt, max_new_tokens=MAX_NEW)
    assert logits[0, 0].argmax(-1).tolist() == tokens                          # greedy: the top logit


def test_context_logits_come_with_the_response(tiny_server, hf_tiny):
    import torch
    prompt = random_prompts([12], 512, seed=64)[0]
    stream = Stream(tiny_server.grpc_url).send(trtllm_inputs(prompt, 2, False,
                                                             return_context_logits=np.array([[True]])))
    [result] = stream.results()
    stream.close()
    with torch.no_grad():
        want = hf_tiny(torch.tensor([prompt])).logits.float().numpy()
    assert np.allclose(result.as_numpy("context_logits"), want, atol=1e-4)


def test_perf_metrics_and_token_counts_come_with_the_response(tiny_server):
    inputs = trtllm_inputs([5] * 20, MAX_NEW, False, return_perf_metrics=np.array([[True]]),
                           return_num_input_tokens=np.array([[True]]), return_num_output_tokens=np.array([[True]]))
    stream = Stream(tiny_server.grpc_url).send(inputs)
    [result] = stream.results()
    stream.close()
    value = lambda name: int(result.as_numpy(name)[0, 0])                          # noqa: E731
    assert value("num_input_tokens") == 20 and value("num_output_tokens") == MAX_NEW
    assert value("kv_cache_alloc_new_blocks") == value("kv_cache_alloc_total_blocks") == 2    # 25 tokens, blocks of 16
    assert value("kv_cache_reused_blocks") == 0
    times = [value(n) for n in ("arrival_time_ns", "first_scheduled_time_ns", "first_token_time_ns",
                                "last_token_time_ns")]
    assert 0 < times[0] <= times[1] <= times[2] <= times[3]


def engine_outputs(engine, prompt: list[int], **params) -> dict:
    """The in-process engine's outputs of one request: tokens, top ids and log probs, the prompt's log probs."""
    request_id = engine.add_request(prompt, max_new_tokens=MAX_NEW, **params)
    got = {"tokens": [], "top_ids": [], "top_log_probs": [], "prompt": None}
    while engine.has_unfinished:
        for out in engine.step():
            assert out.request_id == request_id and out.error is None
            got["tokens"] += out.new_token_ids
            got["top_ids"] += out.top_ids
            got["top_log_probs"] += out.top_log_probs
            got["prompt"] = out.prompt_log_probs or got["prompt"]
    return got


@pytest.mark.parametrize("streaming", [True, False])
def test_top_and_prompt_log_probs_equal_the_engines(tiny_server, engine, streaming):
    """Our extensions: num_top_log_probs gives each new token's top k (output_top_log_probs / _ids
    [1, 1, n, k]), return_prompt_log_probs the prompt's (prompt_log_probs [1, P], its first NaN, with ranks and
    the top k [1, P, k]) once, with the first response."""
    prompt, k = random_prompts([11], 512, seed=63)[0], 3
    want = engine_outputs(engine, prompt, return_log_probs=True, top_log_probs=k, return_prompt_log_probs=True)
    stream = Stream(tiny_server.grpc_url).send(trtllm_inputs(
        prompt, MAX_NEW, streaming, return_log_probs=np.array([[True]]), num_top_log_probs=np.array([[k]], np.int32),
        return_prompt_log_probs=np.array([[True]]), exclude_input_in_output=np.array([[True]])))
    results = stream.results()
    stream.close()
    tokens = [t for r in results if r.as_numpy("output_ids") is not None for t in r.as_numpy("output_ids")[0, 0]]
    tops = [r for r in results if r.as_numpy("output_top_log_prob_ids") is not None]
    ids = np.concatenate([r.as_numpy("output_top_log_prob_ids")[0, 0] for r in tops])
    values = np.concatenate([r.as_numpy("output_top_log_probs")[0, 0] for r in tops])
    assert tokens == want["tokens"] and ids.shape == (MAX_NEW, k) and ids.tolist() == want["top_ids"]
    # the engine in this process against the server's: once (a fresh-clone run) 7.7e-5 apart, the test's engine off
    # the value the server and a fresh process both gave; well below a wrong token's or position's difference
    np.testing.assert_allclose(values, want["top_log_probs"], atol=1e-4)
    [first] = [r for r in results if r.as_numpy("prompt_log_probs") is not None]
    scored = want["prompt"]
    assert first.as_numpy("prompt_log_probs").shape == (1, len(prompt))
    np.testing.assert_allclose(first.as_numpy("prompt_log_probs")[0], scored.log_probs.numpy(), atol=1e-4)
    assert first.as_numpy("prompt_log_prob_ranks")[0].tolist() == scored.ranks.tolist()
    assert first.as_numpy("prompt_top_log_prob_ids")[0].tolist() == scored.top_ids.tolist()
    np.testing.assert_allclose(first.as_numpy("prompt_top_log_probs")[0], scored.top_log_probs.numpy(), atol=1e-4)


def test_a_batch_of_rows_answers_each_rows_prompt_log_probs(tiny_server, engine):
    """Two rows of other prompt lengths (the shorter padded in input_ids): each row's own prompt scored."""
    prompts = random_prompts([4, 9], 512, seed=64)
    arrays = {"input_ids": np.array([prompts[0] + [0] * 5, prompts[1]], np.int32),
              "input_lengths": np.array([[4], [9]], np.int32), "request_output_len": np.array([[2], [3]], np.int32),
              "num_top_log_probs": np.array([[2], [2]], np.int32),
              "return_prompt_log_probs": np.array([[True], [True]])}
    stream = Stream(tiny_server.grpc_url).send(arrays)
    results = stream.results()
    stream.close()
    got = {r.as_numpy("batch_index")[0, 0]: r for r in results if r.as_numpy("batch_index") is not None}
    for index, prompt in enumerate(prompts):
        want = engine_outputs(engine, prompt, top_log_probs=2, return_prompt_log_probs=True)
        assert got[index].as_numpy("prompt_top_log_prob_ids")[0].tolist() == want["prompt"].top_ids.tolist()
