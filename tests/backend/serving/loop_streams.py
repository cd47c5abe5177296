"""Fake server streams for the engine loop's tests: each records what the loop sends it."""
import threading

import numpy as np

from backend.core.request import RequestLimits
from backend.serving.protocol import parse_request
from tests.helpers import random_prompts

TIMEOUT_S = 60


class FakeStream:
    """A server's response channel, recording what the loop sends; `broken` makes every emit raise."""

    def __init__(self, prompt: list[int], max_new_tokens: int = 5, broken: bool = False, **extra):
        arrays = {"input_ids": np.array([prompt], dtype=np.int32),
                  "request_output_len": np.array([[max_new_tokens]], dtype=np.int32)} | extra
        self.requests = parse_request(arrays, LIMITS)
        self.broken = broken
        self.tokens: list[int] = []
        self.num_emits = 0
        self.answers: list[str] = []              # "finish", "fail: ...", "cancelled"
        self.done = threading.Event()

    def is_cancelled(self) -> bool:
        return False

    def emit(self, out, batch_index: int, last: bool) -> None:
        if self.broken:
            raise ConnectionError("client went away")
        self.tokens += out.new_token_ids
        self.num_emits += 1
        if last:
            self._answer("finish")

    def fail(self, message: str) -> None:
        self._answer(f"fail: {message}")

    def cancelled(self) -> None:
        self._answer("cancelled")

    def _answer(self, what: str) -> None:
        self.answers.append(what)
        self.done.set()

    def wait(self) -> "FakeStream":
        assert self.done.wait(TIMEOUT_S), "the stream got no final answer"
        return self


LIMITS = RequestLimits(max_input_len=511)      # the tiny model's


def prompts(engine, n: int) -> list[list[int]]:
    return random_prompts([7 + 3 * i for i in range(n)], engine.model_config.vocab_size, seed=21)
