"""TensorRT-LLM's request contract in process: batch rows, inputs of features we lack, embedding bias, top-p
decay, the perf metrics, num_return_sequences sharing their prompt's KV blocks."""
import numpy as np
import pytest

from backend import LLMEngine
from backend.core.request import RequestError, RequestLimits, SamplingParams
from backend.serving.contract import IGNORED, UNSUPPORTED
from backend.serving.output_arrays import merge_rows
from backend.serving.protocol import check_declared, parse_request
from tests.helpers import random_prompts

LIMITS = RequestLimits(max_input_len=511)
BASE = {"input_ids": np.array([[5, 6, 7]], dtype=np.int32), "request_output_len": np.array([[4]], dtype=np.int32)}

# a value that asks for the feature, per input of UNSUPPORTED
NON_NEUTRAL = {name: np.array([[1]], dtype=np.int32) for name in UNSUPPORTED} | {
    "draft_logits": np.ones((1, 2, 8), dtype=np.float32),
    "prompt_embedding_table": np.ones((1, 2, 8), dtype=np.float16),
    "encoder_input_features": np.ones((1, 2, 8), dtype=np.float16),
    "cross_attention_mask": np.ones((1, 2, 2), dtype=bool),
    "mrope_rotary_cos_sin": np.ones((1, 8), dtype=np.float32),
    "retention_decode_priority": np.array([[80]], dtype=np.int32),
    "retention_decode_duration_ms": np.array([[1000]], dtype=np.int32),
    "skip_cross_attn_blocks": np.array([[True]]),
}


def neutral(name: str) -> np.ndarray:
    accepted = UNSUPPORTED[name][1]
    return np.array([[accepted[0]]]) if accepted else np.zeros((1, 0), dtype=np.int32)


@pytest.mark.parametrize("name", sorted(UNSUPPORTED))
def test_an_input_of_a_feature_we_lack_accepts_its_neutral_value_and_refuses_others(name):
    [row] = parse_request(BASE | {name: neutral(name)}, LIMITS)
    assert row.prompt_ids == [5, 6, 7]
    with pytest.raises(RequestError, match=f"^{name}: .* is not supported by this server; {name} must be"):
        parse_request(BASE | {name: NON_NEUTRAL[name]}, LIMITS)


@pytest.mark.parametrize("name", IGNORED)
def test_draft_and_prompt_table_knobs_are_ignored_as_tensorrt_llm_does_without_them(name):
    [row] = parse_request(BASE | {name: np.array([[3]], dtype=np.int32)}, LIMITS)
    assert row.params == parse_request(BASE, LIMITS)[0].params


def test_beam_search_inputs_are_read_and_all_beams_returned_unless_num_return_sequences_says():
    beams = {"beam_width": np.array([[4]], dtype=np.int32), "len_penalty": np.array([[0.5]], dtype=np.float32),
             "early_stopping": np.array([[False]])}
    [row] = parse_request(BASE | beams, LIMITS)
    p = row.params
    assert (p.beam_width, p.length_penalty, p.early_stopping, p.num_return_sequences) == (4, 0.5, False, 4)
    [row] = parse_request(BASE | beams | {"num_return_sequences": np.array([[2]], dtype=np.int32)}, LIMITS)
    assert row.params.num_return_sequences == 2
    [row] = parse_request(BASE | {"beam_search_diversity_rate": np.array([[0.5]], dtype=np.float32)}, LIMITS)
    row.params.validate(vocab_size=100, limits=LIMITS)                 # beam width 1: not read, as TensorRT-LLM
    [row] = parse_request(BASE | beams | {"beam_search_diversity_rate": np.array([[0.5]], dtype=np.float32)},
                          LIMITS)
    with pytest.raises(RequestError, match="^beam_search_diversity_rate: diverse beam search is not supported"):
        row.params.validate(vocab_size=100, limits=RequestLimits(max_input_len=16, max_beam_width=4))


@pytest.mark.parametrize("name,shape,words", [
    ("input_ids", [1, 2**62], ["input_ids", "4611686018427387904 values", "1024"]),
    ("lora_weights", [1, 2**62, 2], ["lora_weights", "more than the 1024"]),
    ("lora_weights", [1, 33, 32], ["lora_weights", "1056 values"]),
    ("input_ids", [1, -4], ["input_ids", "negative"])])
def test_a_declared_shape_past_the_bound_is_refused_by_name_before_any_data(name, shape, words):
    limits = RequestLimits(max_input_len=16, max_input_values=1024)
    check_declared({"input_ids": [1, 16], "lora_weights": [1, 32, 32]}, limits)
    with pytest.raises(RequestError) as err:
        check_declared({"request_output_len": [1, 1], name: shape}, limits)
    assert err.value.field == name and all(w in str(err.value) for w in words)


def test_a_batch_of_rows_becomes_one_request_per_row_trimmed_to_its_length():
    arrays = {"input_ids": np.array([[5, 6, 7, 0], [8, 9, 10, 11]], dtype=np.int32),
              "input_lengths": np.array([3, 4], dtype=np.int32),
              "request_output_len": np.array([[2], [6]], dtype=np.int32),
              "temperature": np.array([[0.5], [1.0]], dtype=np.float32)}
    rows = parse_request(arrays, LIMITS)
    assert [r.prompt_ids for r in rows] == [[5, 6, 7], [8, 9, 10, 11]]
    assert [r.params.max_new_tokens for r in rows] == [2, 6]
    with pytest.raises(RequestError, match=r"^request_output_len: batch size 1 differs from input_ids' 2"):
        parse_request(arrays | {"request_output_len": np.array([[2]], dtype=np.int32)}, LIMITS)
    with pytest.raises(RequestError, match=r"^input_lengths: 5 does not fit .* \(batch index 1\)"):
        parse_request(arrays | {"input_lengths": np.array([3, 5], dtype=np.int32)}, LIMITS)


def test_contract_inputs_reach_the_sampling_params():
    bias = np.zeros((1, 512), dtype=np.float32)
    [row] = parse_request(BASE | {"num_return_sequences": np.array([[3]], dtype=np.int32),
                                  "runtime_top_p_min": np.array([[0.1]], dtype=np.float32),
                                  "runtime_top_p_decay": np.array([[0.5]], dtype=np.float32),
                                  "runtime_top_p_reset_ids": np.array([[-1]], dtype=np.int32),
                                  "embedding_bias": bias, "return_perf_metrics": np.array([[True]])}, LIMITS)
    p = row.params
    assert (p.num_return_sequences, p.top_p_decay, p.top_p_reset_id) == (3, 0.5, None)
    assert p.top_p_min == pytest.approx(0.1) and p.embedding_bias.shape == (512,) and row.return_perf_metrics


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return LLMEngine(tiny_model_dir, dtype="float32", kernel_backend="torch", kv_block_size=4,
                     kv_cache_memory_bytes=1 << 20)


def run(engine, prompt, **params) -> dict[int, list[int]]:
    """Tokens per sequence index, and the engine's blocks all free again at the end."""
    request_id = engine.add_request(prompt, SamplingParams(**params))
    tokens, finished = {}, False
    while engine.has_unfinished:
        for out in engine.step():
            assert out.request_id == request_id and not out.error and not finished
            tokens.setdefault(out.sequence_index, []).extend(out.new_token_ids)
            finished = out.request_finished
    assert finished and engine.blocks.num_used_blocks == 0
    return tokens


def test_embedding_bias_moves_the_greedy_choice(engine):
    prompt = random_prompts([9], 512, seed=3)[0]
    [first] = run(engine, prompt, max_new_tokens=1).values()
    bias = np.zeros(512, dtype=np.float32)
    bias[first[0]] = -1e4                                      # as if banned
    assert run(engine, prompt, max_new_tokens=1, embedding_bias=bias) == run(
        engine, prompt, max_new_tokens=1, bad_words=[first])
    bias[:] = 0
    bias[77] = 1e4
    assert run(engine, prompt, max_new_tokens=5, embedding_bias=bias) == {0: [77] * 5}
    with pytest.raises(RequestError, match=r"embedding_bias: must hold one value per vocabulary entry \(512\)"):
        engine.add_request(prompt, SamplingParams(embedding_bias=np.zeros(3, dtype=np.float32)))


def test_top_p_decay_narrows_sampling_to_greedy_after_the_first_token(engine):
    prompt = random_prompts([11], 512, seed=4)[0]
    sampled = dict(temperature=1.0, top_p=0.95, seed=7, max_new_tokens=8)
    [tokens] = run(engine, prompt, **sampled, top_p_decay=1e-6, top_p_min=1e-6).values()
    assert run(engine, prompt + tokens[:1], max_new_tokens=7) == {0: tokens[1:]}    # greedy after the first
    [plain] = run(engine, prompt, **sampled).values()
    assert plain[0] == tokens[0] and plain != tokens                 # same first draw, then no decay
    [reset] = run(engine, prompt, **sampled, top_p_decay=1e-6, top_p_min=1e-6, top_p_reset_id=tokens[1]).values()
    assert reset[:2] == tokens[:2]                  # then the reset token restores top_p 0.95 for one draw
    assert reset[2] != tokens[2] and run(engine, prompt + reset[:3], max_new_tokens=5) == {0: reset[3:]}


@pytest.mark.parametrize("prompt_len", [8, 9, 11])                 # the last prompt block full, or not
def test_return_sequences_share_the_prompt_blocks_and_sample_as_separate_seeds(engine, prompt_len):
    prompt = random_prompts([prompt_len], 512, seed=prompt_len)[0]
    greedy = run(engine, prompt, max_new_tokens=6, num_return_sequences=3)
    assert greedy == {i: run(engine, prompt, max_new_tokens=6)[0] for i in range(3)}
    sampled = dict(temperature=1.0, top_k=20, max_new_tokens=6)
    together = run(engine, prompt, **sampled, seed=11, num_return_sequences=3)
    alone = {i: run(engine, prompt, **sampled, seed=11 + (i << 32))[0] for i in range(3)}
    assert together == alone and len({tuple(t) for t in together.values()}) > 1


def test_forks_reuse_the_prompt_blocks_and_report_them(engine):
    prompt = random_prompts([10], 512, seed=5)[0]
    request_id = engine.add_request(prompt, SamplingParams(max_new_tokens=3, num_return_sequences=2))
    first, second = engine.seqs[request_id]
    while not second.block_table:                             # the prompt, and the fork at its first token
        engine.step()
    assert second.block_table[:2] == first.block_table[:2] and second.block_table[2] != first.block_table[2]
    assert [engine.blocks.ref_counts[b] for b in first.block_table[:2]] == [2, 2]
    assert (second.metrics.num_reused_blocks, second.metrics.num_new_blocks) == (2, 1)
    while engine.has_unfinished:
        engine.step()
    m = first.metrics
    assert 0 < m.arrival_time_ns <= m.first_scheduled_time_ns <= m.first_token_time_ns <= m.last_token_time_ns
    assert engine.blocks.num_used_blocks == 0


def test_each_output_reports_the_perf_metrics_as_of_its_own_step(engine):
    """A server may send an output while the engine steps on (backend/serving/responder.py)."""
    request_id = engine.add_request(random_prompts([10], 512, seed=7)[0], SamplingParams(max_new_tokens=4))
    outputs = []
    while engine.has_unfinished:
        outputs += engine.step()
    token_times = [out.metrics.last_token_time_ns for out in outputs]
    assert len(outputs) == 4 and token_times == sorted(set(token_times))
    blocks = [out.metrics.num_new_blocks for out in outputs]     # a step ahead allocates before the last one lands
    assert blocks == ([3, 3, 4, 4] if engine.overlap else [3, 3, 3, 4]) and request_id not in engine.seqs


def test_aborting_a_request_ends_every_sequence_and_frees_their_blocks(engine):
    request_id = engine.add_request(random_prompts([10], 512, seed=6)[0],
                                    SamplingParams(max_new_tokens=20, num_return_sequences=4))
    engine.step()
    engine.step()
    assert engine.abort(request_id) and not engine.has_unfinished and engine.blocks.num_used_blocks == 0


def test_generation_logits_are_the_models_logits_of_each_new_token(engine, hf_tiny):
    import torch
    prompt = random_prompts([9], 512, seed=8)[0]
    request_id = engine.add_request(prompt, SamplingParams(max_new_tokens=4, return_generation_logits=True,
                                                           repetition_penalty=1.5))
    tokens, rows = [], []
    while engine.has_unfinished:
        for out in engine.step():
            assert out.request_id == request_id
            tokens += out.new_token_ids
            rows += [out.generation_logits] if out.new_token_ids else []
    with torch.no_grad():
        hf = hf_tiny(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1:]
    assert torch.allclose(torch.stack(rows), hf.float(), atol=1e-4)   # raw: before the repetition penalty


@pytest.mark.parametrize("max_num_batched_tokens", [8, 64])
def test_context_logits_are_the_models_logits_over_the_prompt_in_chunks(tiny_model_dir, hf_tiny, monkeypatch,
                                                                        max_num_batched_tokens):
    """In chunks of 8 tokens, and in one (the logits arrive in the step that samples the first token)."""
    import torch

    import backend.core.intake
    chunked = LLMEngine(tiny_model_dir, dtype="float32", kernel_backend="torch", kv_block_size=4,
                        kv_cache_memory_bytes=1 << 20, max_num_batched_tokens=max_num_batched_tokens,
                        enable_kv_cache_reuse=True)
    prompt = random_prompts([23], 512, seed=9)[0]
    for _ in range(2):                              # the second time its blocks are cached, but not reused
        chunked.add_request(prompt, SamplingParams(max_new_tokens=2, return_context_logits=True))
        [context] = [out.context_logits for out in iter_outputs(chunked) if out.context_logits is not None]
        with torch.no_grad():
            assert torch.allclose(context, hf_tiny(torch.tensor([prompt])).logits[0].float(), atol=1e-4)
    monkeypatch.setattr(backend.core.intake, "MAX_CONTEXT_LOGITS_BYTES", 8 << 10)
    with pytest.raises(RequestError, match=r"return_context_logits: 23 prompt tokens x vocabulary 512 logits exceed"):
        chunked.add_request(prompt, SamplingParams(return_context_logits=True))


def iter_outputs(engine):
    while engine.has_unfinished:
        yield from engine.step()


def test_merged_rows_pad_every_dim_past_the_batch():
    """One response for rows of other lengths: ids padded with -1, values with 0, in every dim (tokens and k)."""
    rows = [{"output_top_log_prob_ids": np.ones((1, 1, 2, 3), np.int32), "prompt_log_probs": np.ones((1, 4), np.float32)},
            {"output_top_log_prob_ids": np.ones((1, 1, 5, 3), np.int32), "prompt_log_probs": np.ones((1, 2), np.float32)}]
    merged = merge_rows(rows)
    ids, scored = merged["output_top_log_prob_ids"], merged["prompt_log_probs"]
    assert ids.shape == (2, 1, 5, 3) and (ids[0, 0, 2:] == -1).all() and (ids[0, 0, :2] == 1).all()
    assert scored.tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
