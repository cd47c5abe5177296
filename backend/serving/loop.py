"""The engine loop a server runs: one background thread steps the engine; requests arrive from other threads.

Framework-free: a server hands in `Stream` objects (its own response channel per request) and gets each request's
outputs back through them, called on the responder thread (backend/serving/responder.py) while the engine steps on.
Every stream ends exactly once: its last `emit`, `fail` or `cancelled`.
"""
import queue
import threading
import time
from typing import Callable, Protocol

import torch

from backend.core.engine import LLMEngine
from backend.core.outputs import StepOutput, TokenRow
from backend.core.request import FatalEngineError, RequestError
from backend.heap import HeapTrimmer, freeze_heap, unfreeze_heap
from backend.openmp import one_openmp_thread, release_openmp_pool
from backend.serving.compiles import GrammarCompiles
from backend.serving.protocol import ParsedRequest
from backend.serving.responder import STEPS_BEHIND, Responder, client_cancelled
from backend.serving.uploads import Uploads


class Stream(Protocol):
    """One client request's response channel, implemented by the server. A request holds one or more rows (its
    batch), each an engine request with one or more sequences (num_return_sequences)."""
    requests: list[ParsedRequest]

    def is_cancelled(self) -> bool: ...
    def emit(self, out: StepOutput, batch_index: int, last: bool) -> None: ...   # last: the request's final output
    def fail(self, message: str) -> None: ...               # an error response, final
    def cancelled(self) -> None: ...                        # a final response after a cancellation


class EngineLoop:
    """Steps the engine on its own thread and never lets an exception end that thread: a failed step fails the
    requests in flight, a failing sender closes only its stream, and after `max_step_failures` failed steps in
    a row (or one FatalEngineError) the engine is declared broken: every pending and new request is answered with
    an error at once.
    Whether a client cancelled is asked every `cancellation_check_period_s`, as TensorRT-LLM's backend does with
    its `cancellation_check_period_ms`: a round trip per stream in Triton. With
    `ask_on_responder` (the default on an accelerator) the responder asks between its answers and sends the
    cancelled streams back through the inbox while the engine steps; on CPU the loop asks between steps, since a
    round trip beside a step preempts one of the OpenMP team's threads."""

    def __init__(self, engine: LLMEngine, on_step: Callable[[LLMEngine, float | None], None] | None = None,
                 idle_wait_s: float = 0.05, max_step_failures: int = 3, cancellation_check_period_s: float = 0.1,
                 ask_on_responder: bool | None = None, max_steps_behind: int = STEPS_BEHIND):
        if max_steps_behind < 1:
            raise ValueError(f"responder_steps_behind must be >= 1, got {max_steps_behind}")
        if cancellation_check_period_s < 0:
            raise ValueError(f"cancellation_check_period_ms must be >= 0, got {cancellation_check_period_s * 1e3:g}")
        self.engine = engine
        self.on_step = on_step                               # metrics hook: (engine, step seconds or None)
        self.idle_wait_s = idle_wait_s
        self.max_step_failures = max_step_failures
        self.cancellation_check_period_s = cancellation_check_period_s
        self.max_steps_behind = max_steps_behind
        self._next_cancellation_check = 0.0                  # time.monotonic() of the next check
        self.ask_on_responder = engine.runner.device.type != "cpu" if ask_on_responder is None else ask_on_responder
        self.inbox: queue.Queue = queue.Queue()
        self.rows: dict[int, tuple[Stream, int]] = {}       # engine request id -> its stream and batch index
        self.streams: dict[Stream, list[int]] = {}          # stream -> its engine requests still in flight
        self.names: dict[str, Stream] = {}                  # client request id -> its stream
        self.name_of: dict[Stream, str] = {}                # and back
        self.broken: str | None = None                      # why the engine can serve no more, once it cannot
        self.num_step_failures = 0                          # in a row
        self.num_hook_errors = 0
        self.step_started: float | None = None              # time.monotonic() of the step running now
        self.uploads = Uploads(engine)                      # parsing off the loop, bounded
        self.compiles = GrammarCompiles(engine, on_compiled=lambda stream, name: self.inbox.put(("add", stream, name)),
                                        on_refused=lambda stream: self.uploads.release(stream.requests))
        self.heap = HeapTrimmer().start()                   # freed uploads' pages back to the system
        self._running = True
        self._aborted_while_idle = False
        self.responder = Responder(on_broken=lambda stream: self.inbox.put(("broken", stream, "")),
                                   on_cancelled=lambda stream: self.inbox.put(("cancelled", stream, "")))
        self.thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        freeze_heap()                                       # the engine's start-up, out of the collector's passes
        self.thread.start()
        release_openmp_pool()                               # the loop thread's CPU ops are the only ones that last

    @property
    def alive(self) -> bool:
        return self.broken is None and self.thread.is_alive()

    def submit(self, stream: Stream, name: str = "") -> None:
        """Queue a request for the loop. Runs on the caller's thread, which also parses the adapter weights the
        request brings, so that parsing never stalls the streams in flight. A request with a grammar to compile goes
        to a compile thread first (the compile in a bounded worker process): no other request waits on it."""
        if not self.alive:
            stream.fail(f"engine unavailable: {self.broken or 'the engine loop has stopped'}")
            return
        try:
            with one_openmp_thread():                       # beside the loop's threads, not against them
                for r in stream.requests:
                    self.uploads.prepare(r)
        except RequestError as err:
            self.uploads.release(stream.requests)
            stream.fail(str(err))
            return
        finally:
            release_openmp_pool()                           # what parsing started (see release_openmp_pool)
        if self.compiles.needs(stream):
            self.compiles.start(stream, name)                # then into the inbox, or answered
        else:
            self.inbox.put(("add", stream, name))

    def cancel(self, name: str) -> bool:
        """Abort the in-flight request with this client request id. False if there is none."""
        found = self.compiles.stop(name) or name in self.names
        self.inbox.put(("cancel", None, name))
        return found

    def stop(self, message: str = "server is shutting down") -> None:
        self._running = False
        self.inbox.put(("wake", None, ""))
        self.compiles.close()
        self.thread.join(timeout=30)
        self._fail_everything(message)
        self.responder.stop()
        self.heap.stop()
        unfreeze_heap()

    @torch.inference_mode()                                  # once, not a step at a time
    def _run(self) -> None:
        while self._running:
            try:
                self._tick()
            except Exception as exc:                         # never let the loop thread die
                self._step_failed(exc)

    def _tick(self) -> None:
        self._drain(block=not self.engine.has_unfinished)
        self._check_cancellations()
        if not self.engine.has_unfinished:
            if self._aborted_while_idle:                     # the figures changed without a step
                self._hook(None)
            self._aborted_while_idle = False
            return
        start = time.perf_counter()
        self._aborted_while_idle = False
        self.step_started = time.monotonic()
        try:
            outputs = self.engine.step()
        finally:
            self.step_started = None
        self.num_step_failures = 0
        self._hook(time.perf_counter() - start)
        self.responder.wait_behind(self.max_steps_behind - 1)   # answers of at most max_steps_behind steps queued
        emits: list[tuple[Stream, StepOutput | TokenRow, int, bool]] = []
        for entry in outputs.entries:
            if type(entry) is StepOutput:
                self._deliver(entry, emits)
            else:                                            # a sequence's new token, not its last: as it is
                route = self.rows.get(entry[0].request_id)
                if route is not None:
                    emits.append((route[0], entry, route[1], False))
        self.responder.emit(emits)

    def _step_failed(self, exc: Exception) -> None:
        """A failure outside any one request's input: fail every request in flight; break after several in a row, or
        at once where the engine says it cannot go on."""
        self.num_step_failures += 1
        message = f"engine failure: {type(exc).__name__}: {exc}"
        if self.num_step_failures >= self.max_step_failures or isinstance(exc, FatalEngineError):
            self.broken = f"{message} ({self.num_step_failures} steps failed in a row)"
            self._fail_everything(f"engine unavailable: {self.broken}")
        else:
            self._fail_in_flight(message)
        self._hook(None)

    def _fail_in_flight(self, message: str) -> None:
        for stream in list(self.streams):
            for request_id in self.streams[stream]:
                try:
                    self.engine.abort(request_id)
                except Exception:                            # the engine is failing already: still answer
                    pass
            self._close(stream)
            self.responder.fail(stream, message)

    def _fail_everything(self, message: str) -> None:
        self._fail_in_flight(message)
        while True:
            try:
                op, stream, _ = self.inbox.get_nowait()
            except queue.Empty:
                return
            if op == "add":
                self.uploads.release(stream.requests)
                self.responder.fail(stream, message)
            elif op == "broken":
                self.responder.forget(stream)

    def _hook(self, seconds: float | None) -> None:
        if self.on_step is not None:
            try:
                self.on_step(self.engine, seconds)
            except Exception:                                # figures are not worth a request
                self.num_hook_errors += 1

    def _drain(self, block: bool) -> None:
        try:
            item = self.inbox.get(timeout=self.idle_wait_s) if block else self.inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(*item)
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, op: str, stream: Stream | None, name: str) -> None:
        if op == "cancel":
            if name in self.names:
                self._abort(self.names[name])
        elif op == "cancelled":                              # its client cancelled it (the responder asked)
            if stream in self.streams:
                self._abort(stream)
        elif op == "broken":                                 # its sender failed: stop its rows (answered already)
            self._stop(stream)
            self.responder.forget(stream)
        elif op == "add":
            self.uploads.release(stream.requests)
            if name and name in self.names:
                self.responder.fail(stream, f"request_id: {name!r} is already in flight; send a stop request "
                                            "first or use another id")
                return
            request_ids = []
            try:
                for r in stream.requests:
                    request_ids.append(self.engine.add_request(r.prompt_ids, r.params, lora=r.lora))
            except Exception as err:                          # never let one request take the loop down
                for request_id in request_ids:
                    self.engine.abort(request_id)
                prefix = f"batch index {len(request_ids)}: " if len(stream.requests) > 1 else ""
                detail = str(err) if isinstance(err, RequestError) else f"engine failure: {err}"
                self.responder.fail(stream, prefix + detail)
                return
            self.streams[stream] = request_ids
            for batch_index, request_id in enumerate(request_ids):
                self.rows[request_id] = (stream, batch_index)
            if self.ask_on_responder:
                self.responder.watch(stream)
            if name:
                self.names[name] = stream
                self.name_of[stream] = name

    def _check_cancellations(self) -> None:
        now = time.monotonic()
        if now < self._next_cancellation_check or not self.streams:
            return
        self._next_cancellation_check = now + self.cancellation_check_period_s
        if self.ask_on_responder:
            self.responder.check_cancellations()
            return
        for stream in [s for s in self.streams if client_cancelled(s)]:
            self._abort(stream)

    def _abort(self, stream: Stream) -> None:
        self._stop(stream)
        self.responder.cancelled(stream)
        self._aborted_while_idle = True

    def _deliver(self, out: StepOutput, emits: list) -> None:
        """Route an output to its stream: added to the step's `emits`, or, an error, sent after them."""
        if out.request_id not in self.rows:
            return
        stream, batch_index = self.rows[out.request_id]
        if out.request_finished:
            del self.rows[out.request_id]
            self.streams[stream].remove(out.request_id)
        last = not self.streams[stream]
        if out.error:
            self._stop(stream)                               # the other rows end with it
            self.responder.emit(emits[:])                    # what came before it, first
            emits.clear()
            self.responder.fail(stream, out.error)
            return
        if last:
            self._close(stream)
        emits.append((stream, out, batch_index, last))

    def _stop(self, stream: Stream) -> None:
        """Abort the stream's rows still in flight, and close it."""
        for request_id in self.streams.get(stream, []):
            self.engine.abort(request_id)
        self._close(stream)

    def _close(self, stream: Stream) -> None:
        for request_id in self.streams.pop(stream, []):
            self.rows.pop(request_id, None)
        name = self.name_of.pop(stream, None)
        if name is not None:
            del self.names[name]
