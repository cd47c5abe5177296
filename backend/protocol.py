"""TensorRT-LLM backend's I/O contract, framework-free: input arrays -> an engine request, outputs -> arrays.

Arrays arrive as Triton hands them to a model with max_batch_size >= 1: each request's tensors carry a
leading batch dim of 1 (input_ids [1, L], scalars [1], lora_weights [1, N, R], words lists [1, 2, L]).
"""
from dataclasses import dataclass

import numpy as np

from backend.request import RequestError, RequestLimits, SamplingParams, check_finite


@dataclass(slots=True)
class ParsedRequest:
    prompt_ids: list[int]
    params: SamplingParams
    streaming: bool = False
    exclude_input_in_output: bool = False
    stop: bool = False
    lora_task_id: int | None = None
    lora_weights: np.ndarray | None = None
    lora_config: np.ndarray | None = None
    lora_adapter: object | None = None        # the weights parsed off the engine thread (backend/lora/format.py)


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


def parse_request(arrays: dict[str, np.ndarray], limits: RequestLimits) -> ParsedRequest:
    """Map the contract's inputs onto an engine request, every size checked before the work it bounds. Sampling
    follows TensorRT-LLM: greedy unless runtime_top_k > 1 or runtime_top_p > 0; temperature scales the sampled
    distribution. A `stop` request is honoured before anything else is read (TensorRT-LLM's clients send it with
    placeholder inputs: input_ids [[0]], input_lengths [[0]], request_output_len [[0]]); end_id -1 means none."""
    if _scalar(arrays, "stop", bool, False):
        return ParsedRequest(prompt_ids=[], params=SamplingParams(), stop=True)
    if "input_ids" not in arrays:
        raise RequestError("input_ids", "is required")
    if "request_output_len" not in arrays:
        raise RequestError("request_output_len", "is required")
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
    words = {name: parse_words(name, arrays[name], limits) if name in arrays else []
             for name in ("stop_words_list", "bad_words_list")}
    params = SamplingParams(
        max_new_tokens=_scalar(arrays, "request_output_len", int),
        temperature=temperature if sampling else 0.0,
        top_k=top_k,
        top_p=top_p if top_p > 0.0 else 1.0,
        seed=seed,
        end_id=None if end_id == -1 else end_id,
        min_tokens=_scalar(arrays, "min_tokens", int, _scalar(arrays, "min_length", int, 0)),
        stop_words=words["stop_words_list"],
        bad_words=words["bad_words_list"],
        repetition_penalty=_scalar(arrays, "repetition_penalty", float, 1.0),
        presence_penalty=_scalar(arrays, "presence_penalty", float, 0.0),
        frequency_penalty=_scalar(arrays, "frequency_penalty", float, 0.0),
        return_log_probs=_scalar(arrays, "return_log_probs", bool, False),
        beam_width=_scalar(arrays, "beam_width", int, 1),
    )
    if params.temperature == 0.0 and sampling:
        params.top_k = 1                           # temperature 0 with sampling asked for: greedy
    lora_weights = arrays.get("lora_weights")
    lora_config = arrays.get("lora_config")
    return ParsedRequest(
        prompt_ids=prompt,
        params=params,
        streaming=_scalar(arrays, "streaming", bool, False),
        exclude_input_in_output=_scalar(arrays, "exclude_input_in_output", bool, False),
        lora_task_id=_scalar(arrays, "lora_task_id", int),
        lora_weights=None if lora_weights is None else np.asarray(lora_weights),
        lora_config=None if lora_config is None else np.asarray(lora_config),
    )


def output_arrays(token_ids: list[int], log_probs: list[float] | None) -> dict[str, np.ndarray]:
    """One response's tensors for one request: output_ids [1, beam=1, n], sequence_length [1, 1], and the
    log probs [1, 1] / [1, 1, n] (zeros where not asked for)."""
    n = len(token_ids)
    log_probs = log_probs if log_probs and len(log_probs) == n else [0.0] * n
    return {
        "output_ids": np.array(token_ids, dtype=np.int32).reshape(1, 1, n),
        "sequence_length": np.array([[n]], dtype=np.int32),
        "cum_log_probs": np.array([[sum(log_probs)]], dtype=np.float32),
        "output_log_probs": np.array(log_probs, dtype=np.float32).reshape(1, 1, n),
    }
