"""Cancellation in the engine loop: asked once a period, by the loop or on the responder thread, never of a stream
after its final answer, and never holding up the engine's steps when the responder asks."""
import threading
import time

import pytest

from backend import LLMEngine
from backend.serving.loop import EngineLoop
from tests.backend.serving.loop_streams import TIMEOUT_S, FakeStream, prompts


@pytest.fixture()
def engine(tiny_model_dir):
    return LLMEngine(tiny_model_dir, dtype="float32", kernel_backend="torch", kv_cache_memory_bytes=1 << 20)


class CancellableStream(FakeStream):
    """A client that cancels after `after` tokens; counts how often the loop asks."""

    def __init__(self, prompt: list[int], after: int, **kwargs):
        super().__init__(prompt, **kwargs)
        self.after, self.num_checks = after, 0

    def is_cancelled(self) -> bool:
        self.num_checks += 1
        return len(self.tokens) >= self.after


@pytest.mark.parametrize("ask_on_responder", [False, True])
def test_cancellation_is_asked_once_a_period_not_every_step(engine, ask_on_responder):
    period_s = 0.05
    loop = EngineLoop(engine, idle_wait_s=0.01, cancellation_check_period_s=period_s,
                      ask_on_responder=ask_on_responder)
    stream = CancellableStream(prompts(engine, 1)[0], after=60, max_new_tokens=400)
    start = time.monotonic()
    loop.submit(stream)
    assert stream.wait().answers == ["cancelled"] and 60 <= len(stream.tokens) < 400
    assert stream.num_checks <= (time.monotonic() - start) / period_s + 2 < len(stream.tokens)
    assert engine.blocks.num_used_blocks == 0
    loop.stop()


class StalledCheckStream(FakeStream):
    """A client whose first cancellation check blocks until released, as a round trip to a busy tritonserver does;
    records the threads that ask, and any question after the final answer (which crashes tritonserver)."""

    def __init__(self, prompt: list[int], **kwargs):
        super().__init__(prompt, **kwargs)
        self.asking, self.release = threading.Event(), threading.Event()
        self.askers: set[threading.Thread] = set()
        self.asked_after_final = False
        self.steps: list = []                     # the loop's steps so far, if the test counts them
        self.steps_when_asked: int | None = None

    def is_cancelled(self) -> bool:
        if self.steps_when_asked is None:
            self.steps_when_asked = len(self.steps)
        self.askers.add(threading.current_thread())
        self.asked_after_final |= self.done.is_set()
        self.asking.set()
        assert self.release.wait(TIMEOUT_S)
        return False


def test_cancellation_is_asked_off_the_engine_thread_which_steps_on_while_a_check_blocks(engine):
    stream = StalledCheckStream(prompts(engine, 1)[0], max_new_tokens=30)
    want = engine.generate([stream.requests[0].prompt_ids], max_new_tokens=30)[0]
    steps = stream.steps                            # the seconds of each step
    loop = EngineLoop(engine, on_step=lambda engine, seconds: seconds is None or steps.append(seconds),
                      idle_wait_s=0.01, cancellation_check_period_s=0.0, ask_on_responder=True)
    loop.submit(stream)
    assert stream.asking.wait(TIMEOUT_S)
    # counted as the check began (the loop may run its one step ahead before this thread looks)
    num_steps, deadline = stream.steps_when_asked, time.monotonic() + TIMEOUT_S / 2   # before a stalled check gives up
    while len(steps) == num_steps and time.monotonic() < deadline:
        time.sleep(0.005)
    assert len(steps) > num_steps                   # a step ran while the check was still waiting
    stream.release.set()
    assert stream.wait().tokens == want and stream.answers == ["finish"]
    assert stream.askers and loop.thread not in stream.askers and not stream.asked_after_final
    loop.stop()


def test_no_stream_is_asked_after_its_final_answer(engine):
    streams = [StalledCheckStream(p, max_new_tokens=3 + 4 * i) for i, p in enumerate(prompts(engine, 6))]
    for s in streams:
        s.release.set()
    loop = EngineLoop(engine, idle_wait_s=0.01, cancellation_check_period_s=0.0, ask_on_responder=True)
    for s in streams:
        loop.submit(s)
    assert all(s.wait().answers == ["finish"] for s in streams)
    loop.responder.wait_idle()
    loop.stop()
    assert all(s.askers for s in streams) and not any(s.asked_after_final for s in streams)
    assert not loop.responder.watched


def test_a_negative_cancellation_period_is_refused(engine):
    with pytest.raises(ValueError, match="cancellation_check_period_ms must be >= 0"):
        EngineLoop(engine, cancellation_check_period_s=-0.001)
