"""A TensorRT-LLM request's answers (backend/serving/responses.py), without Triton: what each response carries as a
request's outputs arrive, streamed or whole, one row or a batch, and its one final answer whatever ends it."""
import numpy as np
import pytest
import torch

from backend.core.outputs import StepOutput
from backend.core.request import RequestError, RequestLimits
from backend.serving.metrics import ServerMetrics
from backend.serving.protocol import parse_request
from backend.serving.responses import ResponseStream, check_unary

LIMITS = RequestLimits(max_input_len=64)
PROMPT = [5, 6, 7]


class RecordingSender:
    def __init__(self, cancelled: bool = False):
        self.responses: list[tuple[dict[str, np.ndarray], bool]] = []
        self.errors: list[str] = []
        self.cancelled = cancelled

    def send(self, arrays: dict[str, np.ndarray], final: bool) -> None:
        assert not self.finished, "a response after the final one"
        self.responses.append((arrays, final))

    def send_error(self, message: str) -> None:
        assert not self.finished, "an error after the final response"
        self.errors.append(message)

    def is_cancelled(self) -> bool:
        return self.cancelled

    @property
    def finished(self) -> bool:
        return bool(self.errors) or any(final for _, final in self.responses)


class Counter:
    def __init__(self, counts: dict, name: str, labels: dict):
        self.counts, self.key = counts, (name, labels.get("status"))

    def increment(self, n: int) -> None:
        self.counts[self.key] = self.counts.get(self.key, 0) + n

    def observe(self, value: float) -> None:
        self.increment(1)

    def set(self, value: float) -> None:
        self.counts[self.key] = value


def metrics() -> tuple[ServerMetrics, dict]:
    counts: dict = {}

    class Family:
        def __init__(self, name: str, help: str, kind: str):
            self.name = name

        def Metric(self, labels: dict, **kwargs):
            return Counter(counts, self.name, labels)

    return ServerMetrics(Family), counts


def rows(batch: int = 1, **inputs) -> list:
    arrays = {"input_ids": np.array([PROMPT] * batch, dtype=np.int32),
              "request_output_len": np.array([[4]] * batch, dtype=np.int32)}
    return parse_request(arrays | {k: np.array([[v]] * batch) for k, v in inputs.items()}, LIMITS)


def out(tokens: list[int], finished: bool = False, **fields) -> StepOutput:
    return StepOutput("r", tokens, finished=finished, request_finished=finished, log_probs=[-0.5] * len(tokens),
                      **fields)


def test_a_streaming_row_answers_each_output_with_its_new_tokens_and_the_prompt_outputs_once():
    sender, (m, counts) = RecordingSender(), metrics()
    stream = ResponseStream(sender, rows(streaming=True), m)
    stream.emit(out([11], context_logits=torch.ones(3, 8)), 0, False)
    stream.emit(out([12, 13]), 0, False)
    stream.emit(out([14], finished=True), 0, True)
    ids = [a["output_ids"].tolist() for a, _ in sender.responses]
    assert ids == [[[[11]]], [[[12, 13]]], [[[14]]]]
    assert [final for _, final in sender.responses] == [False, False, True]
    assert [("context_logits" in a) for a, _ in sender.responses] == [True, False, False]
    assert sender.responses[0][0]["context_logits"].shape == (1, 3, 8)
    assert sender.responses[1][0]["sequence_length"].tolist() == [[2]]
    assert counts[("lora_llm_requests_total", "success")] == 1


@pytest.mark.parametrize("exclude_input", [False, True])
def test_a_whole_row_answers_once_with_the_prompt_unless_excluded(exclude_input):
    sender, (m, _) = RecordingSender(), metrics()
    stream = ResponseStream(sender, rows(exclude_input_in_output=exclude_input), m)
    stream.emit(out([11]), 0, False)
    stream.emit(out([12, 13], finished=True), 0, True)
    [(arrays, final)] = sender.responses
    want = ([] if exclude_input else PROMPT) + [11, 12, 13]
    assert final and arrays["output_ids"].tolist() == [[want]]
    assert arrays["output_log_probs"].tolist() == [[[0.0] * (len(want) - 3) + [-0.5] * 3]]


def test_a_unary_batch_answers_every_row_in_one_response():
    sender, (m, _) = RecordingSender(), metrics()
    stream = ResponseStream(sender, rows(batch=2, exclude_input_in_output=True), m, unary=True)
    stream.emit(out([21], finished=True), 1, False)
    assert sender.responses == []                                  # held until the last row
    stream.emit(out([11, 12], finished=True), 0, True)
    [(arrays, final)] = sender.responses
    assert final and arrays["output_ids"].shape == (2, 1, 2)       # the rows padded to the longest
    assert arrays["output_ids"][0, 0].tolist() == [11, 12] and arrays["output_ids"][1, 0, 0] == 21
    assert arrays["sequence_length"].tolist() == [[2], [1]]


def test_a_failure_is_the_one_final_answer_and_nothing_follows():
    sender, (m, counts) = RecordingSender(), metrics()
    stream = ResponseStream(sender, rows(streaming=True), m)
    stream.emit(out([11]), 0, False)
    stream.fail("lora_weights: bad")
    stream.fail("again")
    stream.emit(out([12], finished=True), 0, True)
    stream.cancelled()
    assert sender.errors == ["lora_weights: bad"] and len(sender.responses) == 1
    assert counts[("lora_llm_requests_total", "failure")] == 1
    assert not stream.is_cancelled()                               # not asked once answered


def test_a_cancelled_whole_row_answers_with_its_tokens_so_far():
    sender, (m, counts) = RecordingSender(cancelled=True), metrics()
    stream = ResponseStream(sender, rows(), m)
    assert stream.is_cancelled()
    stream.emit(out([11, 12]), 0, False)
    stream.cancelled()
    [(arrays, final)] = sender.responses
    assert final and arrays["output_ids"].tolist() == [[[11, 12]]]
    assert counts[("lora_llm_requests_total", "cancelled")] == 1


def test_unary_requests_refuse_streaming_and_several_sequences_by_name():
    with pytest.raises(RequestError, match="^streaming: "):
        check_unary(rows(streaming=True))
    with pytest.raises(RequestError, match="^num_return_sequences: "):
        check_unary(rows(num_return_sequences=2))
