"""TensorRT-LLM backend's I/O contract, the other way: a request's outputs as the arrays its responses carry
(shapes as tensorrtllm_backend sends them: [1, beams, tokens] and the like, a batch's rows merged)."""
import numpy as np

from backend.core.request import SeqMetrics
from backend.serving.protocol import ParsedRequest


def output_arrays(token_ids: list[int], log_probs: list[float] | None) -> dict[str, np.ndarray]:
    """One response's tensors for one sequence: output_ids [1, beam=1, n], sequence_length [1, 1], and the
    log probs [1, 1] / [1, 1, n] (zeros where not asked for)."""
    n = len(token_ids)
    log_probs = log_probs if log_probs and len(log_probs) == n else [0.0] * n
    return {
        "output_ids": np.array(token_ids, dtype=np.int32).reshape(1, 1, n),
        "sequence_length": np.array([[n]], dtype=np.int32),
        "cum_log_probs": np.array([[sum(log_probs)]], dtype=np.float32),
        "output_log_probs": np.array(log_probs, dtype=np.float32).reshape(1, 1, n),
    }


def beam_arrays(beams: list, prompt: list[int], pad_id: int) -> dict[str, np.ndarray]:
    """A beam search's response for its beams (backend/core/beams.py's Hypothesis, best first): output_ids [1, beams, n]
    (each beam's tokens after `prompt`, padded with pad_id, TensorRT-LLM's end id), sequence_length [1, beams],
    cum_log_probs [1, beams] (each beam's sum of log probs) and output_log_probs [1, beams, n]."""
    n = len(prompt) + max(len(beam.output_ids) for beam in beams)
    ids = np.full((1, len(beams), n), pad_id, dtype=np.int32)
    log_probs = np.zeros((1, len(beams), n), dtype=np.float32)
    for i, beam in enumerate(beams):
        ids[0, i, :len(prompt) + len(beam.output_ids)] = prompt + beam.output_ids
        log_probs[0, i, len(prompt):len(prompt) + len(beam.log_probs)] = beam.log_probs
    return {"output_ids": ids,
            "sequence_length": np.array([[len(prompt) + len(beam.output_ids) for beam in beams]], dtype=np.int32),
            "cum_log_probs": np.array([[beam.cum_log_prob for beam in beams]], dtype=np.float32),
            "output_log_probs": log_probs}


def top_arrays(ids: list[list[int]], log_probs: list[list[float]], request: ParsedRequest) -> dict[str, np.ndarray]:
    """Our extension (num_top_log_probs): each new token's k most likely tokens, output_top_log_probs (FP32) and
    output_top_log_prob_ids (INT32) [1, beam=1, tokens, k]."""
    k = request.params.top_log_probs
    if not k or not ids:
        return {}
    return {"output_top_log_probs": np.array(log_probs, dtype=np.float32).reshape(1, 1, len(ids), k),
            "output_top_log_prob_ids": np.array(ids, dtype=np.int32).reshape(1, 1, len(ids), k)}


def first_arrays(out) -> dict[str, np.ndarray]:
    """What a request's first output brings once: context_logits [1, prompt, vocab], and our extension
    (return_prompt_log_probs) prompt_log_probs [1, prompt] (the first NaN) and prompt_log_prob_ranks [1, prompt]
    (INT32, 1 for the most likely token; the first 0), with num_top_log_probs > 0
    prompt_top_log_probs (FP32) and prompt_top_log_prob_ids (INT32) [1, prompt, k]."""
    arrays = {}
    if out.context_logits is not None:
        arrays["context_logits"] = out.context_logits.numpy()[None]
    scored = out.prompt_log_probs
    if scored is not None:
        arrays["prompt_log_probs"] = scored.log_probs.numpy()[None]
        arrays["prompt_log_prob_ranks"] = scored.ranks.numpy()[None]
        if scored.top_ids.shape[1]:
            arrays["prompt_top_log_probs"] = scored.top_log_probs.numpy()[None]
            arrays["prompt_top_log_prob_ids"] = scored.top_ids.numpy()[None]
    return arrays


def extra_arrays(row: ParsedRequest, batch_size: int, batch_index: int, sequence_index: int,
                 metrics: SeqMetrics | None, num_output_tokens: int) -> dict[str, np.ndarray]:
    """The outputs TensorRT-LLM adds when they say something: batch_index for a batch of several rows,
    sequence_index for several return sequences, the perf metrics and token counts when asked for."""
    out = {}
    if batch_size > 1:
        out["batch_index"] = np.array([[batch_index]], dtype=np.int32)
    if row.params.num_return_sequences > 1 and row.params.beam_width == 1:     # (beams come in one response)
        out["sequence_index"] = np.array([[sequence_index]], dtype=np.int32)
    if row.return_perf_metrics and metrics is not None:
        out |= {name: np.array([[value]], dtype=np.int32) for name, value in (
            ("kv_cache_alloc_new_blocks", metrics.num_new_blocks),
            ("kv_cache_reused_blocks", metrics.num_reused_blocks),
            ("kv_cache_alloc_total_blocks", metrics.num_new_blocks))}
        out |= {name: np.array([[getattr(metrics, name)]], dtype=np.int64) for name in (
            "arrival_time_ns", "first_scheduled_time_ns", "first_token_time_ns", "last_token_time_ns")}
        out |= {"acceptance_rate": np.array([[0.0]], dtype=np.float32),
                "total_accepted_draft_tokens": np.array([[0]], dtype=np.int32),
                "total_draft_tokens": np.array([[0]], dtype=np.int32)}
    if row.return_num_input_tokens:
        out["num_input_tokens"] = np.array([[len(row.prompt_ids)]], dtype=np.int32)
    if row.return_num_output_tokens:
        out["num_output_tokens"] = np.array([[num_output_tokens]], dtype=np.int32)
    return out


def generation_logits(rows: list[np.ndarray], request: ParsedRequest) -> dict[str, np.ndarray]:
    """generation_logits [1, beam=1, tokens, vocab], when the request asked for them."""
    if not request.params.return_generation_logits or not rows:
        return {}
    return {"generation_logits": np.stack(rows)[None, None].astype(np.float32)}


def merge_rows(rows: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """One response for a batch of rows: each output stacked along the batch dim, padded with -1 (ids) or 0."""
    merged = {}
    for name in rows[0]:
        arrays = [r[name] for r in rows if name in r]
        if len(arrays) < len(rows):
            continue
        shape = np.max([a.shape for a in arrays], axis=0)
        pad = -1 if name.endswith("_ids") else 0
        merged[name] = np.concatenate([np.pad(a, [(0, 0)] + [(0, int(m) - d) for m, d in zip(shape[1:], a.shape[1:])],
                                              constant_values=pad) for a in arrays])
    merged.pop("batch_index", None)                # the position in the response says it
    return merged
