"""TensorRT-LLM backend's I/O contract, framework-free: input arrays -> engine requests (outputs -> arrays:
backend/serving/output_arrays.py).

Arrays arrive as Triton hands them to a model with max_batch_size >= 1: each request's tensors carry a
leading batch dim (input_ids [B, L], scalars [B] or [B, 1], lora_weights [B, N, R], words lists [B, 2, L]).
Each of the B rows is an engine request of its own, answered with its batch_index.
"""
import math
from dataclasses import dataclass

import numpy as np

from backend.core.request import RequestError, RequestLimits, SamplingParams, check_finite
from backend.lora.request import LoraRequest
from backend.serving.contract import check_unsupported


@dataclass(slots=True)
class ParsedRequest:
    """One row of a client request."""
    prompt_ids: list[int]
    params: SamplingParams
    streaming: bool = False
    exclude_input_in_output: bool = False
    stop: bool = False
    lora: LoraRequest | None = None           # its adapter (weights parsed off the engine thread: serving/uploads.py)
    return_perf_metrics: bool = False
    return_num_input_tokens: bool = False
    return_num_output_tokens: bool = False


def _unbatch(name: str, value: np.ndarray) -> np.ndarray:
    value = np.asarray(value)
    if value.ndim >= 1 and value.shape[0] != 1:
        raise RequestError(name, f"batch dim must be 1 per request, got shape {list(value.shape)}")
    return value[0] if value.ndim >= 1 else value


def _scalar(arrays: dict, name: str, kind, default=None):
    if name not in arrays:
        return default
    value = _unbatch(name, arrays[name]).reshape(-1)
    if value.size != 1:
        raise RequestError(name, f"must hold one value, got {value.size}")
    if kind is bool:
        return bool(value[0])
    if kind is int:
        if value.dtype.kind not in "iub":
            raise RequestError(name, f"must be an integer, got dtype {value.dtype}")
        return int(value[0])
    check_finite(name, float(value[0]))
    return float(value[0])


def parse_words(name: str, value: np.ndarray, limits: RequestLimits) -> list[list[int]]:
    """TensorRT-LLM words list [2, L]: row 0 the ids of all words back to back, row 1 each word's end offset,
    both padded with -1."""
    value = _unbatch(name, value)
    if value.ndim != 2 or value.shape[0] != 2:
        raise RequestError(name, f"must be [2, L] (ids row, offsets row), got shape {list(value.shape)}")
    if value.dtype.kind not in "iu":
        raise RequestError(name, f"must be INT32, got dtype {value.dtype}")
    if value.shape[1] > limits.max_words * limits.max_word_len:
        raise RequestError(name, f"{value.shape[1]} ids exceed max_words {limits.max_words} x max_word_len "
                                 f"{limits.max_word_len}")
    ids, offsets = value[0].tolist(), [int(o) for o in value[1] if o >= 0]
    words, start = [], 0
    for end in offsets:
        if not start <= end <= len(ids):
            raise RequestError(name, f"offset {end} out of range [{start}, {len(ids)}]")
        if end > start:
            words.append([int(t) for t in ids[start:end]])
        start = end
    return words


def check_declared(shapes: dict[str, list[int]], limits: RequestLimits) -> None:
    """Every input's declared shape within bounds, before its data is read: a shape whose byte count wraps around
    64 bits passes tritonserver's size check with no data at all."""
    for name, shape in shapes.items():
        dims = [int(d) for d in shape]
        if any(d < 0 for d in dims):
            raise RequestError(name, f"declared shape {dims} has a negative dimension")
        if (num_values := math.prod(dims)) > limits.max_input_values:
            raise RequestError(name, f"declared shape {dims} holds {num_values} values, more than the "
                                     f"{limits.max_input_values} any input may hold")


def parse_request(arrays: dict[str, np.ndarray], limits: RequestLimits) -> list[ParsedRequest]:
    """Map the contract's inputs onto engine requests, one per batch row, every size checked before the work it
    bounds. A `stop` request is honoured before anything else is read (TensorRT-LLM's clients send it with
    placeholder inputs: input_ids [[0]], input_lengths [[0]], request_output_len [[0]])."""
    if "stop" in arrays and np.asarray(arrays["stop"]).size and bool(np.asarray(arrays["stop"]).any()):
        return [ParsedRequest(prompt_ids=[], params=SamplingParams(), stop=True)]
    for name in ("input_ids", "request_output_len"):
        if name not in arrays:
            raise RequestError(name, "is required")
    batch_size = np.asarray(arrays["input_ids"]).shape[0] if np.ndim(arrays["input_ids"]) else 1
    if batch_size < 1:
        raise RequestError("input_ids", "holds no request (batch size 0)")
    for name, value in arrays.items():
        if np.ndim(value) and np.shape(value)[0] != batch_size:
            raise RequestError(name, f"batch size {np.shape(value)[0]} differs from input_ids' {batch_size}")
    if batch_size == 1:
        return [parse_row(arrays, limits)]
    rows = []
    for b in range(batch_size):
        try:
            rows.append(parse_row({name: value[b:b + 1] if np.ndim(value) else value
                                   for name, value in arrays.items()}, limits))
        except RequestError as err:
            raise RequestError(err.field, f"{err.message} (batch index {b})") from None
    return rows


def parse_row(arrays: dict[str, np.ndarray], limits: RequestLimits) -> ParsedRequest:
    """One batch row. Sampling follows TensorRT-LLM: greedy unless runtime_top_k > 1 or runtime_top_p > 0;
    temperature scales the sampled distribution; end_id -1 means none."""
    check_unsupported(arrays)
    ids = _unbatch("input_ids", arrays["input_ids"])
    if ids.dtype.kind not in "iu":
        raise RequestError("input_ids", f"must be INT32, got dtype {ids.dtype}")
    if ids.size > limits.max_input_len:
        raise RequestError("input_ids", f"{ids.size} tokens exceed the model's max input length "
                                        f"{limits.max_input_len}")
    prompt = ids.reshape(-1).tolist()
    length = _scalar(arrays, "input_lengths", int)
    if length is not None:
        if not 0 < length <= len(prompt):
            raise RequestError("input_lengths", f"{length} does not fit input_ids of length {len(prompt)}")
        prompt = prompt[:length]

    top_k = _scalar(arrays, "runtime_top_k", int, 0)
    top_p = _scalar(arrays, "runtime_top_p", float, 0.0)
    if not 0.0 <= top_p <= 1.0:
        raise RequestError("runtime_top_p", f"must be in [0, 1] (0: no top-p), got {top_p}")
    sampling = top_k > 1 or top_p > 0.0
    temperature = _scalar(arrays, "temperature", float, 1.0)   # read (and checked) even where greedy ignores it
    end_id = _scalar(arrays, "end_id", int)
    seed = _scalar(arrays, "seed", int, _scalar(arrays, "random_seed", int))
    beam_width = _scalar(arrays, "beam_width", int, 1)
    words = {name: parse_words(name, arrays[name], limits) if name in arrays else []
             for name in ("stop_words_list", "bad_words_list")}
    params = SamplingParams(
        max_new_tokens=_scalar(arrays, "request_output_len", int),
        temperature=temperature if sampling else 0.0,
        top_k=top_k,
        top_p=top_p if top_p > 0.0 else 1.0,
        min_p=_scalar(arrays, "runtime_min_p", float, 0.0),
        seed=seed,
        end_id=None if end_id == -1 else end_id,
        min_tokens=_scalar(arrays, "min_tokens", int, _scalar(arrays, "min_length", int, 0)),
        stop_words=words["stop_words_list"],
        bad_words=words["bad_words_list"],
        repetition_penalty=_scalar(arrays, "repetition_penalty", float, 1.0),
        presence_penalty=_scalar(arrays, "presence_penalty", float, 0.0),
        frequency_penalty=_scalar(arrays, "frequency_penalty", float, 0.0),
        return_log_probs=_scalar(arrays, "return_log_probs", bool, False),
        top_log_probs=_scalar(arrays, "num_top_log_probs", int, 0),
        return_prompt_log_probs=_scalar(arrays, "return_prompt_log_probs", bool, False),
        return_generation_logits=_scalar(arrays, "return_generation_logits", bool, False),
        return_context_logits=_scalar(arrays, "return_context_logits", bool, False),
        beam_width=beam_width,
        length_penalty=_scalar(arrays, "len_penalty", float, 1.0),
        early_stopping=_scalar(arrays, "early_stopping", bool, True),
        diversity_rate=_scalar(arrays, "beam_search_diversity_rate", float, 0.0),
        num_return_sequences=_scalar(arrays, "num_return_sequences", int, beam_width),   # beams: all of them
        top_p_min=_scalar(arrays, "runtime_top_p_min", float, 1e-6),
        top_p_decay=_scalar(arrays, "runtime_top_p_decay", float, 1.0),
        top_p_reset_id=_reset_id(_scalar(arrays, "runtime_top_p_reset_ids", int)),
        embedding_bias=_embedding_bias(arrays),
        guide_type=_string(arrays, "guided_decoding_guide_type") or None,
        guide=_string(arrays, "guided_decoding_guide"),
    )
    if params.temperature == 0.0 and sampling:
        params.top_k = 1                           # temperature 0 with sampling asked for: greedy
    lora_weights, lora_config = arrays.get("lora_weights"), arrays.get("lora_config")
    lora = LoraRequest.of(_scalar(arrays, "lora_task_id", int),
                          None if lora_weights is None else np.asarray(lora_weights),
                          None if lora_config is None else np.asarray(lora_config))
    return ParsedRequest(
        prompt_ids=prompt,
        params=params,
        streaming=_scalar(arrays, "streaming", bool, False),
        exclude_input_in_output=_scalar(arrays, "exclude_input_in_output", bool, False),
        lora=lora,
        return_perf_metrics=_scalar(arrays, "return_perf_metrics", bool, False) or
        _scalar(arrays, "return_kv_cache_reuse_stats", bool, False),
        return_num_input_tokens=_scalar(arrays, "return_num_input_tokens", bool, False),
        return_num_output_tokens=_scalar(arrays, "return_num_output_tokens", bool, False),
    )


def _string(arrays: dict, name: str) -> str:
    if name not in arrays:
        return ""
    value = _unbatch(name, arrays[name]).reshape(-1)
    if value.size != 1:
        raise RequestError(name, f"must hold one string, got {value.size}")
    text = value[0]
    return text.decode("utf-8", errors="replace") if isinstance(text, bytes) else str(text)


def _reset_id(value: int | None) -> int | None:
    return None if value is None or value < 0 else value            # -1: no reset token


def _embedding_bias(arrays: dict) -> np.ndarray | None:
    """embedding_bias [vocab] fp32, added to the logits; empty means none. Its length is checked against the
    vocabulary by SamplingParams.validate."""
    if "embedding_bias" not in arrays:
        return None
    bias = _unbatch("embedding_bias", arrays["embedding_bias"]).reshape(-1)
    if bias.size == 0:
        return None
    if bias.dtype.kind != "f":
        raise RequestError("embedding_bias", f"must be FP32, got dtype {bias.dtype}")
    return bias.astype(np.float32)
