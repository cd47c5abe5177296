"""The engine loop a server runs: one background thread steps the engine; requests arrive from other threads.

Framework-free: a server hands in `Stream` objects (its own response channel per request) and gets each
request's outputs back through them. Every stream ends exactly once: `finish`, `fail` or `cancelled`.
"""
import queue
import threading
import time
from typing import Callable, Protocol

from backend.engine import LLMEngine, StepOutput
from backend.protocol import ParsedRequest
from backend.request import RequestError


class Stream(Protocol):
    """One request's response channel, implemented by the server."""
    request: ParsedRequest

    def is_cancelled(self) -> bool: ...
    def emit(self, out: StepOutput) -> None: ...            # new tokens; the last one has out.finished
    def fail(self, message: str) -> None: ...               # an error response, final
    def cancelled(self) -> None: ...                        # a final response after a cancellation


class EngineLoop:
    def __init__(self, engine: LLMEngine, on_step: Callable[[LLMEngine, float | None], None] | None = None,
                 idle_wait_s: float = 0.05):
        self.engine = engine
        self.on_step = on_step                               # metrics hook: (engine, step seconds or None)
        self.idle_wait_s = idle_wait_s
        self.inbox: queue.Queue = queue.Queue()
        self.streams: dict[int, Stream] = {}
        self.names: dict[str, int] = {}                     # client request id -> engine request id
        self.name_of: dict[int, str] = {}                   # and back
        self._running = True
        self._aborted_while_idle = False
        self.thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.thread.start()

    def submit(self, stream: Stream, name: str = "") -> None:
        self.inbox.put(("add", stream, name))

    def cancel(self, name: str) -> bool:
        """Abort the in-flight request with this client request id. False if there is none."""
        found = name in self.names
        self.inbox.put(("cancel", None, name))
        return found

    def stop(self, message: str = "server is shutting down") -> None:
        self._running = False
        self.inbox.put(("wake", None, ""))
        self.thread.join(timeout=30)
        while not self.inbox.empty():
            op, stream, _ = self.inbox.get_nowait()
            if op == "add":
                stream.fail(message)
        for request_id in list(self.streams):
            self.engine.abort(request_id)
            self.streams.pop(request_id).fail(message)

    def _run(self) -> None:
        while self._running:
            self._drain(block=not self.engine.has_unfinished)
            self._reap_cancelled()
            if not self.engine.has_unfinished:
                if self._aborted_while_idle and self.on_step is not None:   # the figures changed without a step
                    self.on_step(self.engine, None)
                self._aborted_while_idle = False
                continue
            start = time.perf_counter()
            self._aborted_while_idle = False
            outputs = self.engine.step()
            if self.on_step is not None:
                self.on_step(self.engine, time.perf_counter() - start)
            for out in outputs:
                self._deliver(out)

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
            request_id = self.names.get(name)
            if request_id is not None and request_id in self.streams:
                self._abort(request_id)
        elif op == "add":
            r = stream.request
            try:
                request_id = self.engine.add_request(r.prompt_ids, r.params, lora_task_id=r.lora_task_id,
                                                     lora_weights=r.lora_weights, lora_config=r.lora_config)
            except RequestError as err:
                stream.fail(str(err))
                return
            except Exception as err:                          # never let one request take the loop down
                stream.fail(f"engine failure: {err}")
                return
            self.streams[request_id] = stream
            if name:
                self.names[name] = request_id
                self.name_of[request_id] = name

    def _reap_cancelled(self) -> None:
        for request_id in [rid for rid, stream in self.streams.items() if stream.is_cancelled()]:
            self._abort(request_id)

    def _abort(self, request_id: int) -> None:
        self.engine.abort(request_id)
        self._close(request_id).cancelled()
        self._aborted_while_idle = True

    def _deliver(self, out: StepOutput) -> None:
        stream = self.streams.get(out.request_id)
        if stream is None:
            return
        if out.finished:
            self._close(out.request_id)
        if out.error:
            stream.fail(out.error)
        else:
            stream.emit(out)

    def _close(self, request_id: int) -> Stream:
        name = self.name_of.pop(request_id, None)
        if name is not None and self.names.get(name) == request_id:    # a newer request may reuse the name
            del self.names[name]
        return self.streams.pop(request_id)
