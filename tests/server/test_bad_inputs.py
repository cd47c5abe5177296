"""The bad-input matrix on a real tritonserver: every input's wrong dtype, shape, emptiness, sign, range, NaN, inf
and size, every adapter defect, a stop without an id and a duplicate id. Each is answered with one final error
that names the field (and the limit where there is one) while a concurrent stream completes unchanged."""
import time

import numpy as np
import pytest

from tests.helpers import random_prompts
from tests.server.streams import Stream, run, trtllm_inputs

I32, U64, F32, F16 = np.int32, np.uint64, np.float32, np.float16
DROP = None                                    # an override of None removes the input


def scalar(value, dtype) -> np.ndarray:
    return np.array([[value]], dtype)


def words(ids: list[int], offsets: list[int]) -> np.ndarray:
    width = max(len(ids), len(offsets))
    return np.array([[ids + [-1] * (width - len(ids)), offsets + [-1] * (width - len(offsets))]], I32)


def lora(config_rows: list[list[int]], width: int = 4096, task_id: int = 900, fill: float = 0.01) -> dict:
    weights = np.full((1, len(config_rows), width), fill, F16)
    return {"lora_task_id": scalar(task_id, U64), "lora_weights": weights,
            "lora_config": np.array([config_rows], I32).reshape(1, len(config_rows), 3)}


# name -> (overrides of a valid request, substrings the error must contain: the field first)
CASES = {
    "input_ids int64": ({"input_ids": np.array([[5, 6]], np.int64)}, ["input_ids"]),
    "input_ids empty": ({"input_ids": np.zeros((1, 0), I32), "input_lengths": DROP}, ["input_ids", "empty"]),
    "input_ids negative": ({"input_ids": np.array([[5, -1]], I32), "input_lengths": DROP}, ["input_ids", "[0, 512)"]),
    "input_ids past the vocabulary": ({"input_ids": np.array([[5, 2**31 - 1]], I32), "input_lengths": DROP},
                                      ["input_ids", "[0, 512)"]),
    "input_ids too long": ({"input_ids": np.full((1, 600), 5, I32), "input_lengths": DROP},
                           ["input_ids", "600 tokens exceed", "511"]),
    "input_ids batch of two": ({"input_ids": np.array([[5, 6], [7, 8]], I32), "input_lengths": DROP},
                               ["input_ids"]),
    "input_lengths too long": ({"input_lengths": scalar(9, I32)}, ["input_lengths", "does not fit"]),
    "input_lengths zero": ({"input_lengths": scalar(0, I32)}, ["input_lengths"]),
    "input_lengths negative": ({"input_lengths": scalar(-2, I32)}, ["input_lengths"]),
    "request_output_len missing": ({"request_output_len": DROP}, ["request_output_len"]),
    "request_output_len fp32": ({"request_output_len": scalar(4, F32)}, ["request_output_len"]),
    "request_output_len zero": ({"request_output_len": scalar(0, I32)}, ["request_output_len", "> 0"]),
    "request_output_len negative": ({"request_output_len": scalar(-4, I32)}, ["request_output_len", "> 0"]),
    "request_output_len huge": ({"request_output_len": scalar(2**31 - 1, I32)},
                                ["request_output_len", "max_position_embeddings 512"]),
    "end_id past the vocabulary": ({"end_id": scalar(99999, I32)}, ["end_id", "[0, 512)"]),
    "end_id negative": ({"end_id": scalar(-7, I32)}, ["end_id", "[0, 512)"]),
    "beam_width 99": ({"beam_width": scalar(99, I32)}, ["beam_width", "max_beam_width 8"]),
    "beam_width 0": ({"beam_width": scalar(0, I32)}, ["beam_width", "outside [1, 8]"]),
    "beam diversity": ({"beam_width": scalar(2, I32), "beam_search_diversity_rate": scalar(0.5, F32)},
                       ["beam_search_diversity_rate", "must be 0"]),
    "temperature nan": ({"temperature": scalar(np.nan, F32), "runtime_top_k": scalar(5, I32)},
                        ["temperature", "finite"]),
    "temperature inf": ({"temperature": scalar(np.inf, F32)}, ["temperature", "finite"]),
    "temperature negative": ({"temperature": scalar(-1, F32), "runtime_top_k": scalar(5, I32)},
                             ["temperature", ">= 0"]),
    "runtime_top_k negative": ({"runtime_top_k": scalar(-3, I32)}, ["runtime_top_k", ">= 0"]),
    "runtime_top_p above 1": ({"runtime_top_p": scalar(1.5, F32)}, ["runtime_top_p", "[0, 1]"]),
    "runtime_top_p negative": ({"runtime_top_p": scalar(-0.5, F32)}, ["runtime_top_p", "[0, 1]"]),
    "runtime_top_p nan": ({"runtime_top_p": scalar(np.nan, F32)}, ["runtime_top_p", "finite"]),
    "repetition_penalty zero": ({"repetition_penalty": scalar(0, F32)}, ["repetition_penalty", "> 0"]),
    "repetition_penalty nan": ({"repetition_penalty": scalar(np.nan, F32)}, ["repetition_penalty", "finite"]),
    "presence_penalty inf": ({"presence_penalty": scalar(np.inf, F32)}, ["presence_penalty", "finite"]),
    "frequency_penalty nan": ({"frequency_penalty": scalar(np.nan, F32)}, ["frequency_penalty", "finite"]),
    "min_tokens negative": ({"min_tokens": scalar(-1, I32)}, ["min_tokens", ">= 0"]),
    "seed int32": ({"seed": scalar(3, I32)}, ["seed"]),
    "streaming int32": ({"streaming": scalar(1, I32)}, ["streaming"]),
    "stop_words_list shape": ({"stop_words_list": np.zeros((1, 3, 4), I32)},
                              ["stop_words_list", "Expected [-1,2,-1]"]),
    "stop_words_list token": ({"stop_words_list": words([5, 70000], [2])}, ["stop_words_list", "[0, 512)"]),
    "stop_words_list offset": ({"stop_words_list": words([5, 6], [9])}, ["stop_words_list", "offset 9"]),
    "bad_words_list too many ids": ({"bad_words_list": words([5] * 70000, [70000])},
                                    ["bad_words_list", "max_words 1024 x max_word_len 64"]),
    "bad_words_list long word": ({"bad_words_list": words([5] * 65, [65])}, ["bad_words_list", "max_word_len 64"]),
    "bad_words_list many words": ({"bad_words_list": words([5] * 1025, list(range(1, 1026)))},
                                  ["bad_words_list", "1025 words exceed max_words 1024"]),
    "lora_task_id unknown": ({"lora_task_id": scalar(424242, U64)}, ["LoRA task 424242 not found in cache"]),
    "lora_weights without config": ({**lora([[1, 0, 4]]), "lora_config": DROP}, ["lora_config", "together"]),
    "lora_weights without task id": ({**lora([[1, 0, 4]]), "lora_task_id": DROP}, ["lora_task_id", "must be set"]),
    "lora_config module 42": (lora([[42, 0, 4]]), ["lora_config", "unknown module id 42"]),
    "lora_config cross attention": (lora([[9, 0, 4]]), ["lora_config", "module 9 (cross_attn_q) is unsupported"]),
    "lora_config experts on a dense model": (lora([[13, 0, 4]]), ["lora_config", "module 13 (moe_h_to_4h): "
                                                                  "LlamaForCausalLM is not a mixture of experts"]),
    "lora_config layer": (lora([[1, 5, 4]]), ["lora_config", "layer 5 out of range [0, 2)"]),
    "lora_config rank 0": (lora([[1, 0, 0]]), ["lora_config", "max_lora_rank 64"]),
    "lora_config rank 65": (lora([[1, 0, 65]]), ["lora_config", "rank 65 must be in [1, max_lora_rank 64]"]),
    "lora_config no rows": ({**lora([[1, 0, 4]]), "lora_weights": np.zeros((1, 0, 8), F16),
                             "lora_config": np.zeros((1, 0, 3), I32)}, ["lora_config", "no rows"]),
    "lora_config fp32": ({**lora([[1, 0, 4]]), "lora_config": np.array([[[1, 0, 4]]], F32)}, ["lora_config"]),
    "lora_config two columns": ({**lora([[1, 0, 4]]), "lora_config": np.array([[[1, 0]]], I32)}, ["lora_config"]),
    "lora_weights short row": (lora([[1, 0, 4]], width=100), ["lora_weights", "row 0 has 100 values"]),
    "lora_weights too wide": (lora([[1, 0, 4]], width=200_000), ["lora_weights", "max_lora_rank 64 x (in + out)"]),
    "lora_weights nan": (lora([[1, 0, 4]], fill=np.nan), ["lora_weights", "NaN or Inf"]),
}


LONG_STREAM = 400               # tokens of a good stream still running when a request sent after its first arrives


@pytest.fixture(scope="module")
def reference(new_tiny_engine):
    """The concurrent stream's prompt and its first LONG_STREAM tokens from the in-process engine the server runs."""
    engine = new_tiny_engine()
    prompt = random_prompts([11], 512, seed=45)[0]
    return prompt, engine.generate([prompt], max_new_tokens=LONG_STREAM)[0]


def check_refused_while_another_stream_completes(server, reference, overrides: dict, texts: list[str],
                                                 request_id: str = "", num_tokens: int = 24) -> None:
    """A bad request (overrides on a small good one) sent once a good stream of num_tokens has begun: refused with
    `texts` in its error, and the good stream's tokens unchanged. request_id: the id both requests carry. A try where
    the good stream was over before the bad request left (a loaded machine) proves nothing and is made again."""
    prompt, want = reference
    arrays = {k: v for k, v in (trtllm_inputs([5, 6, 7], 4, True) | overrides).items() if v is not None}
    for _ in range(3):
        bad_stream = Stream(server.grpc_url)                      # its channel is open before the good stream starts
        good = Stream(server.grpc_url).send(trtllm_inputs(prompt, num_tokens, True), request_id=request_id)
        good.wait_first()
        sent_at = time.monotonic()
        bad = run(bad_stream, arrays, request_id=request_id)
        result = good.collect()
        good.close()
        if bad.error is not None or good.final_at is None or good.final_at > sent_at:
            break
    assert bad.error is not None and bad.num_final == 1 and not bad.tokens
    for text in texts:
        assert text in bad.error, bad.error
    assert result.error is None and result.tokens == want[:num_tokens]


def test_the_matrix_has_at_least_forty_cases():
    assert len(CASES) >= 40


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_is_refused_with_its_field_while_another_stream_completes(tiny_server, reference, name):
    overrides, texts = CASES[name]
    check_refused_while_another_stream_completes(tiny_server, reference, overrides, texts)


def test_stop_without_a_request_id_is_refused(tiny_server, reference):
    check_refused_while_another_stream_completes(tiny_server, reference, {"stop": scalar(True, np.bool_)},
                                                 ["A request id must be provided"])


def test_a_second_request_with_an_in_flight_id_is_refused(tiny_server, reference):
    """The first request has begun streaming and has hundreds of tokens to go when the second one arrives (24
    tokens of the tiny model could all be out before a second request is read, and it would rightly run)."""
    check_refused_while_another_stream_completes(tiny_server, reference, {}, ["request_id", "already in flight"],
                                                 request_id="same-id", num_tokens=LONG_STREAM)
