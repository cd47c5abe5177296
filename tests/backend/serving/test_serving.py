"""The engine loop a server runs: faults in a step, a sender or a metrics hook fail only what they touch, the loop
thread lives on, and every request is answered exactly once."""
import threading

import numpy as np
import pytest
import torch

from backend import LLMEngine
from backend.serving.loop import EngineLoop
from tests.backend.serving.loop_streams import TIMEOUT_S, FakeStream, prompts


@pytest.fixture()
def engine(tiny_model_dir):
    return LLMEngine(tiny_model_dir, dtype="float32", kernel_backend="torch", kv_cache_memory_bytes=1 << 20)


@pytest.fixture()
def loop(engine):
    loop = EngineLoop(engine, idle_wait_s=0.01)
    yield loop
    loop.stop()


def test_a_failing_sender_closes_only_its_stream(engine):
    good_prompt, bad_prompt = prompts(engine, 2)
    want = engine.generate([good_prompt], max_new_tokens=5)[0]       # before the loop thread steps the engine
    loop = EngineLoop(engine, idle_wait_s=0.01)
    bad, good = FakeStream(bad_prompt, broken=True), FakeStream(good_prompt)
    loop.submit(bad, "bad")
    loop.submit(good, "good")
    assert good.wait().tokens == want and good.answers == ["finish"]
    assert len(bad.wait().answers) == 1 and bad.answers[0].startswith("fail: response failed")
    assert engine.blocks.num_used_blocks == 0 and not loop.streams and loop.alive
    loop.responder.wait_idle()
    assert not loop.responder.broken                # the loop closed it and the responder forgot it
    loop.stop()


class SlowStream(FakeStream):
    """A sender that blocks on its first token until released, as Triton's does while tritonserver is busy."""

    def __init__(self, prompt: list[int], **kwargs):
        super().__init__(prompt, **kwargs)
        self.sending, self.release = threading.Event(), threading.Event()

    def emit(self, out, batch_index: int, last: bool) -> None:
        if not self.tokens:
            self.sending.set()
            assert self.release.wait(TIMEOUT_S)
        super().emit(out, batch_index, last)


@pytest.mark.parametrize("steps_behind", [1, 4])
def test_the_engine_steps_while_a_send_blocks_but_runs_a_few_steps_ahead_at_most(engine, steps_behind):
    """The responder may fall max_steps_behind steps behind; past 1, the steps it then finds queued go out together,
    one answer a stream with all their tokens."""
    slow, other = SlowStream(prompts(engine, 1)[0], max_new_tokens=20), FakeStream(prompts(engine, 2)[1], 20)
    want = {id(s): engine.generate([s.requests[0].prompt_ids], max_new_tokens=20)[0] for s in (slow, other)}
    loop = EngineLoop(engine, idle_wait_s=0.01, max_steps_behind=steps_behind)   # (after the references: it steps)
    loop.submit(slow)
    loop.submit(other)
    assert slow.sending.wait(TIMEOUT_S)             # with its first token
    threading.Event().wait(0.3)
    (request_id,) = loop.streams[slow]
    assert len(engine.seqs[request_id][0].output_ids) == 1 + steps_behind and not slow.done.is_set()
    slow.release.set()
    assert slow.wait().tokens == want[id(slow)] and other.wait().tokens == want[id(other)]
    assert (slow.num_emits < 20 and other.num_emits < 20) if steps_behind > 1 else slow.num_emits == 20
    loop.stop()

def test_a_steps_outputs_reach_the_responder_in_one_call(engine, monkeypatch):
    """Outputs by the batch: the loop queues a step's answers to its streams as one call (one queue operation and
    one wake-up of the responder a step, not one a token), each stream's in order, finals last."""
    streams = [FakeStream(prompt, max_new_tokens=6) for prompt in prompts(engine, 4)]
    want = [engine.generate([s.requests[0].prompt_ids], max_new_tokens=6)[0] for s in streams]
    loop = EngineLoop(engine, idle_wait_s=0.01)
    queued = []
    put = loop.responder.calls.put
    monkeypatch.setattr(loop.responder.calls, "put", lambda call: (queued.append(call), put(call)))
    steps = []
    monkeypatch.setattr(loop, "on_step", lambda engine, seconds: steps.append(seconds))
    for stream in streams:
        loop.inbox.put(("add", stream, ""))                   # all four before the loop's next step
    assert [s.wait().tokens for s in streams] == want and all(s.answers == ["finish"] for s in streams)
    loop.stop()
    emits = [call[2] for call in queued if call is not None and call[1] == "emit"]
    assert 4 * 6 == sum(len(e) for e in emits) and len(emits) <= len(steps)
    assert max(len(e) for e in emits) == 4                     # a decode step's four tokens in one call


def test_a_failed_step_fails_the_requests_in_flight_and_the_loop_keeps_serving(engine, loop, monkeypatch):
    first, second = prompts(engine, 2)
    schedule = engine.scheduler.schedule
    calls = iter([RuntimeError("injected")])

    def failing_once():
        fault = next(calls, None)
        if fault is not None:
            raise fault
        return schedule()

    monkeypatch.setattr(engine.scheduler, "schedule", failing_once)
    victim = FakeStream(first)
    loop.submit(victim)
    assert victim.wait().answers == ["fail: engine failure: RuntimeError: injected"]
    survivor = FakeStream(second)
    loop.submit(survivor)
    assert survivor.wait().answers == ["finish"] and len(survivor.tokens) == 5
    assert engine.blocks.num_used_blocks == 0 and loop.alive


def test_steps_failing_in_a_row_break_the_engine_and_every_request_is_answered_at_once(engine, loop, monkeypatch):
    def failing():
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine.scheduler, "schedule", failing)
    for prompt in prompts(engine, 3):                # one failed step each
        stream = FakeStream(prompt)
        loop.submit(stream)
        assert stream.wait().answers[0].startswith("fail: engine")
    assert not loop.alive and "device lost" in loop.broken
    late = FakeStream(prompts(engine, 1)[0])
    loop.submit(late)
    assert late.done.is_set() and late.answers[0].startswith("fail: engine unavailable")


@pytest.mark.parametrize("fault", ["CUDA error: an illegal memory access was encountered",
                                   "CUDA error: device-side assert triggered"])
def test_one_device_fault_breaks_the_engine_at_once(engine, loop, monkeypatch, fault):
    """A CUDA error is sticky (every later launch fails too): the first one makes the engine unavailable, so the
    alive gauge drops and the supervisor restarts the server, instead of failing step after step while healthy."""
    def faulting(*args, **kwargs):
        raise RuntimeError(fault)

    monkeypatch.setattr(engine.runner, "launch", faulting)
    victim = FakeStream(prompts(engine, 1)[0])
    loop.submit(victim)
    assert victim.wait().answers[0].startswith("fail: engine unavailable: engine failure: FatalEngineError: device "
                                               "fault")
    assert not loop.alive and fault in loop.broken and loop.num_step_failures == 1


def test_a_metrics_hook_that_raises_costs_no_request(engine):
    def broken_hook(engine, seconds):
        raise ValueError("metrics backend down")

    loop = EngineLoop(engine, on_step=broken_hook, idle_wait_s=0.01)
    try:
        stream = FakeStream(prompts(engine, 1)[0])
        loop.submit(stream)
        assert stream.wait().answers == ["finish"] and loop.num_hook_errors > 0 and loop.alive
    finally:
        loop.stop()


def test_a_second_request_with_an_in_flight_id_is_refused(engine, loop):
    first, second = prompts(engine, 2)
    running = FakeStream(first, max_new_tokens=40)
    duplicate = FakeStream(second)
    loop.submit(running, "req-1")
    loop.submit(duplicate, "req-1")
    assert duplicate.wait().answers[0].startswith("fail: request_id: 'req-1' is already in flight")
    assert running.wait().answers == ["finish"] and len(running.tokens) == 40


def test_shutdown_answers_every_request_once(engine):
    loop = EngineLoop(engine, idle_wait_s=0.01)
    streams = [FakeStream(p, max_new_tokens=200) for p in prompts(engine, 4)]
    for s in streams:
        loop.submit(s)
    loop.stop()
    assert all(len(s.wait().answers) == 1 for s in streams)
    assert engine.blocks.num_used_blocks == 0


def test_lora_weights_are_parsed_on_the_submitting_thread(engine, loop, tiny_adapters):
    from backend.lora.peft import load_lora_dir
    weights, config = load_lora_dir(tiny_adapters[0])
    stream = FakeStream(prompts(engine, 1)[0], lora_task_id=np.array([[3]], dtype=np.uint64),
                        lora_weights=weights[None].astype(np.float32), lora_config=config[None])
    loop.submit(stream)
    assert stream.requests[0].lora.weights is None and stream.requests[0].lora.adapter is not None   # parsed already
    assert stream.wait().answers == ["finish"] and engine.lora_cache.contains(3)
    assert loop.uploads.pending_bytes == 0
    again = FakeStream(prompts(engine, 1)[0], lora_task_id=np.array([[3]], dtype=np.uint64),
                       lora_weights=weights[None].astype(np.float32), lora_config=config[None])
    loop.submit(again)                              # cached already: its weights are not parsed again
    assert again.requests[0].lora.adapter is None and again.wait().answers == ["finish"]
    other = FakeStream(prompts(engine, 1)[0], lora_task_id=np.array([[3]], dtype=np.uint64),
                       lora_weights=2 * weights[None].astype(np.float32), lora_config=config[None])
    loop.submit(other)                              # other weights under a cached id: refused, as the engine API does
    assert other.wait().answers == ["fail: lora_task_id: LoRA task 3 is already cached with different weights"]


def test_the_submitting_thread_parses_on_one_openmp_thread(engine, loop, tiny_adapters, openmp_pool_of_two,
                                                          monkeypatch):
    """Beside the loop's team, not against it (backend.openmp.one_openmp_thread); its own setting comes back."""
    from backend.lora.peft import load_lora_dir
    weights, config = load_lora_dir(tiny_adapters[0])
    parse, teams = engine.lora_cache.parse, []
    monkeypatch.setattr(engine.lora_cache, "parse", lambda *args: (teams.append(torch.get_num_threads()),
                                                                   parse(*args))[1])
    stream = FakeStream(prompts(engine, 1)[0], lora_task_id=np.array([[3]], dtype=np.uint64),
                        lora_weights=weights[None].astype(np.float32), lora_config=config[None])
    loop.submit(stream)
    assert teams == [1] and torch.get_num_threads() == 2
    assert stream.wait().answers == ["finish"]


def test_the_submitting_thread_keeps_no_openmp_workers_beside_the_loops(engine, loop, openmp_pool_of_two):
    """Its pool (a parse's parallel ops, or the model load's) would put the loop thread's workers to sleep between
    parallel ops (backend.openmp.release_openmp_pool)."""
    from tests.helpers import num_threads, settled_num_threads
    first = FakeStream(prompts(engine, 1)[0])
    loop.submit(first)
    first.wait()                                   # the loop thread has its own pool now
    torch.ones(1 << 22).sum()                      # and this thread one again
    with_pool = num_threads()
    stream = FakeStream(prompts(engine, 1)[0])
    loop.submit(stream)
    assert settled_num_threads(with_pool - 1) == with_pool - 1
    assert stream.wait().answers == ["finish"]


def test_the_loop_keeps_the_start_up_objects_out_of_the_collectors_passes(engine):
    """While it serves, what existed at its start is frozen (a full pass over it stalled steps 5-11 ms on a GPU);
    garbage made while serving is still collected, and after stop everything is the collector's again."""
    import gc
    import weakref

    class Cycle:
        pass

    loop = EngineLoop(engine, idle_wait_s=0.01)
    try:
        assert gc.get_freeze_count() > 1000
        made = Cycle()
        made.me = made
        gone = weakref.ref(made)
        del made
        gc.collect()
        assert gone() is None
        stream = FakeStream(prompts(engine, 1)[0])
        loop.submit(stream)
        assert stream.wait().answers == ["finish"]
    finally:
        loop.stop()
    assert gc.get_freeze_count() == 0
