"""A TensorRT-LLM request's answers as its outputs arrive: which arrays each response carries, for all its rows and
sequences. Free of Triton: the model file hands each request's sender in (`Sender`: arrays out, an error out, the
client's cancel in) and converts the arrays to tensors as it sends them."""
import threading
import time
from typing import Protocol

import numpy as np

from backend.core.request import RequestError
from backend.serving.metrics import ServerMetrics
from backend.serving.output_arrays import (beam_arrays, extra_arrays, first_arrays, generation_logits, merge_rows,
                                   output_arrays, top_arrays)
from backend.serving.protocol import ParsedRequest


class Sender(Protocol):
    """One request's response channel (Triton's response sender, in model.py)."""

    def send(self, arrays: dict[str, np.ndarray], final: bool) -> None: ...

    def send_error(self, message: str) -> None: ...           # a final response

    def is_cancelled(self) -> bool: ...


class ResponseStream:
    """One request's answers, for all its rows and sequences (backend/serving/loop.py's Stream); never touched after its
    final response (the lock keeps a question from another thread off a final send in progress). Streaming rows
    answer each step's new tokens, the others each sequence's whole output; without decoupled mode (`unary`) every
    row's output goes in one response."""

    def __init__(self, sender: Sender, rows: list[ParsedRequest], metrics: ServerMetrics, unary: bool = False):
        self.requests = rows
        self.unary = unary
        self.held: dict[int, dict[str, np.ndarray]] = {}                          # unary rows done so far
        self.sender = sender
        self.metrics = metrics
        self.start = time.perf_counter()
        self.outputs: dict[tuple[int, int], tuple[list, list, list, list]] = {}  # (batch, sequence) -> tokens, log
                                                                                  # probs, top ids, top log probs
        self.logits: dict[tuple[int, int], list[np.ndarray]] = {}                # generation logits, if asked
        self.first: dict[int, dict[str, np.ndarray]] = {}                        # batch index -> prompt outputs
        self.done = False
        self.lock = threading.Lock()

    def is_cancelled(self) -> bool:
        with self.lock:
            return not self.done and self.sender.is_cancelled()

    def emit(self, out, batch_index: int, last: bool) -> None:
        if self.done:
            return
        if not self.outputs:
            self.metrics.observe_ttft(time.perf_counter() - self.start)
        row = self.requests[batch_index]
        if out.beams is not None:
            self._emit_beams(out, row, batch_index, last)
            return
        tokens, log_probs, top_ids, top_log_probs = self.outputs.setdefault((batch_index, out.sequence_index),
                                                                            ([], [], [], []))
        tokens += out.new_token_ids
        log_probs += out.log_probs
        top_ids += out.top_ids
        top_log_probs += out.top_log_probs
        if out.sequence_index == 0 and (first := first_arrays(out)):
            self.first[batch_index] = first
        logits = self.logits.setdefault((batch_index, out.sequence_index), [])
        if out.generation_logits is not None:
            logits.append(out.generation_logits.numpy())
        first = self.first.pop(batch_index) if out.sequence_index == 0 and batch_index in self.first and \
            (row.streaming or out.finished) else {}
        if row.streaming and (out.new_token_ids or last):
            arrays = output_arrays(out.new_token_ids, out.log_probs) | first | top_arrays(out.top_ids,
                                                                                         out.top_log_probs, row)
            self._send(arrays | generation_logits(logits[-len(out.new_token_ids):] if out.new_token_ids else [],
                                                  row), last, row, batch_index, out, len(tokens))
        elif not row.streaming and out.finished:
            prompt = [] if row.exclude_input_in_output else row.prompt_ids
            arrays = output_arrays(prompt + tokens, [0.0] * len(prompt) + log_probs) | first
            self._send(arrays | top_arrays(top_ids, top_log_probs, row) | generation_logits(logits, row), last, row,
                       batch_index, out, len(tokens))
        if last:
            self.metrics.count("success")

    def _emit_beams(self, out, row: ParsedRequest, batch_index: int, last: bool) -> None:
        """A beam search's outputs: streaming, each round's beams so far (they change as beams take others'
        places); either way its best beams when it ends, with the prompt unless excluded, as TensorRT-LLM sends
        them."""
        self.outputs[(batch_index, 0)] = ([], [], [], [])          # (its first output counted for the TTFT)
        if row.streaming or out.request_finished:
            prompt = [] if row.streaming or row.exclude_input_in_output else row.prompt_ids
            num_tokens = len(out.beams[0].output_ids)
            pad = row.params.end_id if row.params.end_id is not None else 0
            self._send(beam_arrays(out.beams, prompt, pad), last, row, batch_index, out, num_tokens)
        if last:
            self.metrics.count("success")

    def fail(self, message: str) -> None:
        with self.lock:
            if self.done:
                return
            self.done = True
            self.sender.send_error(message)
        self.metrics.count("failure")

    def acknowledge(self) -> None:
        """The final, empty response to a `stop` request."""
        self._send(output_arrays([], []), True)

    def cancelled(self) -> None:
        if not self.done:                          # counted first: a final response the gone client cannot take
            self.metrics.count("cancelled")        # may fail to send
            row = self.requests[0]
            tokens, log_probs, *_ = ([], []) if row.streaming else self.outputs.get((0, 0), ([], []))
            self._send(output_arrays(tokens, log_probs if tokens else []), True)

    def _send(self, arrays: dict, final: bool, row: ParsedRequest | None = None, batch_index: int = 0, out=None,
              num_tokens: int = 0) -> None:
        if row is not None:
            arrays |= extra_arrays(row, len(self.requests), batch_index, out.sequence_index, out.metrics, num_tokens)
        if self.unary and len(self.requests) > 1:
            self.held[batch_index] = arrays
            if not final:
                return
            arrays = merge_rows([self.held[b] for b in sorted(self.held)])
        with self.lock:
            self.done = final
            self.sender.send(arrays, final)


def check_unary(rows: list[ParsedRequest]) -> None:
    """Without decoupled mode a request gets exactly one response: its rows' outputs together, not streamed."""
    if any(row.streaming for row in rows):
        raise RequestError("streaming", "streaming is only supported in decoupled mode")
    if any(row.params.num_return_sequences > 1 and row.params.beam_width == 1 for row in rows):
        raise RequestError("num_return_sequences", "several sequences of a prompt need decoupled mode (one "
                                                   "response each)")
