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
    """Steps the engine on its own thread and never lets an exception end that thread: a failed step fails the
    requests in flight, a failing sender closes only its stream, and after `max_step_failures` failed steps in
    a row the engine is declared broken: every pending and new request is answered with an error at once."""

    def __init__(self, engine: LLMEngine, on_step: Callable[[LLMEngine, float | None], None] | None = None,
                 idle_wait_s: float = 0.05, max_step_failures: int = 3):
        self.engine = engine
        self.on_step = on_step                               # metrics hook: (engine, step seconds or None)
        self.idle_wait_s = idle_wait_s
        self.max_step_failures = max_step_failures
        self.inbox: queue.Queue = queue.Queue()
        self.streams: dict[int, Stream] = {}
        self.names: dict[str, int] = {}                     # client request id -> engine request id
        self.name_of: dict[int, str] = {}                   # and back
        self.broken: str | None = None                      # why the engine can serve no more, once it cannot
        self.num_step_failures = 0                          # in a row
        self.num_hook_errors = 0
        self.pending_adapter_bytes = 0                      # parsed adapters in the inbox, bounded by the host budget
        self._pending_lock = threading.Lock()
        self._running = True
        self._aborted_while_idle = False
        self.thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.thread.start()

    @property
    def alive(self) -> bool:
        return self.broken is None and self.thread.is_alive()

    def submit(self, stream: Stream, name: str = "") -> None:
        """Queue a request for the loop. Runs on the caller's thread, which also parses the adapter weights the
        request brings, so that a large adapter never stalls the streams in flight."""
        if not self.alive:
            stream.fail(f"engine unavailable: {self.broken or 'the engine loop has stopped'}")
            return
        r = stream.request
        if r.lora_weights is not None and r.lora_config is not None and r.lora_task_id is not None:
            if self.engine.lora_cache.contains(r.lora_task_id):    # cached already: the id is enough
                r.lora_weights = r.lora_config = None
            elif self.pending_adapter_bytes + r.lora_weights.nbytes > self.engine.config.lora.host_memory_bytes:
                stream.fail("lora_weights: adapter uploads waiting for the engine exceed "
                            f"lora_cache_host_memory_bytes {self.engine.config.lora.host_memory_bytes}; retry later")
                return
            else:
                try:
                    r.lora_adapter = self.engine.lora_cache.parse(r.lora_weights, r.lora_config)
                except RequestError as err:
                    stream.fail(str(err))
                    return
                r.lora_weights = r.lora_config = None
                self._count_pending(r.lora_adapter.num_bytes)
        self.inbox.put(("add", stream, name))

    def _count_pending(self, num_bytes: int) -> None:
        with self._pending_lock:
            self.pending_adapter_bytes += num_bytes

    def cancel(self, name: str) -> bool:
        """Abort the in-flight request with this client request id. False if there is none."""
        found = name in self.names
        self.inbox.put(("cancel", None, name))
        return found

    def stop(self, message: str = "server is shutting down") -> None:
        self._running = False
        self.inbox.put(("wake", None, ""))
        self.thread.join(timeout=30)
        self._fail_everything(message)

    def _run(self) -> None:
        while self._running:
            try:
                self._tick()
            except Exception as exc:                         # never let the loop thread die
                self._step_failed(exc)

    def _tick(self) -> None:
        self._drain(block=not self.engine.has_unfinished)
        self._reap_cancelled()
        if not self.engine.has_unfinished:
            if self._aborted_while_idle:                     # the figures changed without a step
                self._hook(None)
            self._aborted_while_idle = False
            return
        start = time.perf_counter()
        self._aborted_while_idle = False
        outputs = self.engine.step()
        self.num_step_failures = 0
        self._hook(time.perf_counter() - start)
        for out in outputs:
            self._deliver(out)

    def _step_failed(self, exc: Exception) -> None:
        """A failure outside any one request's input: fail every request in flight; break after several in a row."""
        self.num_step_failures += 1
        message = f"engine failure: {type(exc).__name__}: {exc}"
        if self.num_step_failures >= self.max_step_failures:
            self.broken = f"{message} ({self.num_step_failures} steps failed in a row)"
            self._fail_everything(f"engine unavailable: {self.broken}")
        else:
            self._fail_in_flight(message)
        self._hook(None)

    def _fail_in_flight(self, message: str) -> None:
        for request_id in list(self.streams):
            try:
                self.engine.abort(request_id)
            except Exception:                                # the engine is failing already: still answer
                pass
            _quietly(self._close(request_id).fail, message)

    def _fail_everything(self, message: str) -> None:
        self._fail_in_flight(message)
        while True:
            try:
                op, stream, _ = self.inbox.get_nowait()
            except queue.Empty:
                return
            if op == "add":
                if stream.request.lora_adapter is not None:
                    self._count_pending(-stream.request.lora_adapter.num_bytes)
                _quietly(stream.fail, message)

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
            request_id = self.names.get(name)
            if request_id is not None and request_id in self.streams:
                self._abort(request_id)
        elif op == "add":
            if stream.request.lora_adapter is not None:
                self._count_pending(-stream.request.lora_adapter.num_bytes)
            if name and name in self.names:
                _quietly(stream.fail, f"request_id: {name!r} is already in flight; send a stop request first or "
                                      "use another id")
                return
            r = stream.request
            try:
                request_id = self.engine.add_request(r.prompt_ids, r.params, lora_task_id=r.lora_task_id,
                                                     lora_weights=r.lora_weights, lora_config=r.lora_config,
                                                     lora_adapter=r.lora_adapter)
            except RequestError as err:
                _quietly(stream.fail, str(err))
                return
            except Exception as err:                          # never let one request take the loop down
                _quietly(stream.fail, f"engine failure: {err}")
                return
            self.streams[request_id] = stream
            if name:
                self.names[name] = request_id
                self.name_of[request_id] = name

    def _reap_cancelled(self) -> None:
        for request_id in [rid for rid, stream in self.streams.items() if _cancelled(stream)]:
            self._abort(request_id)

    def _abort(self, request_id: int) -> None:
        self.engine.abort(request_id)
        _quietly(self._close(request_id).cancelled)
        self._aborted_while_idle = True

    def _deliver(self, out: StepOutput) -> None:
        stream = self.streams.get(out.request_id)
        if stream is None:
            return
        if out.finished:
            self._close(out.request_id)
        try:
            if out.error:
                stream.fail(out.error)
            else:
                stream.emit(out)
        except Exception as exc:                             # a broken sender closes its own stream only
            if not out.finished:
                self.engine.abort(out.request_id)
                self._close(out.request_id)
            _quietly(stream.fail, f"response failed: {exc}")

    def _close(self, request_id: int) -> Stream:
        name = self.name_of.pop(request_id, None)
        if name is not None and self.names.get(name) == request_id:    # a newer request may reuse the name
            del self.names[name]
        return self.streams.pop(request_id)


def _cancelled(stream: Stream) -> bool:
    try:
        return stream.is_cancelled()
    except Exception:                                        # a sender that cannot tell is treated as gone
        return True


def _quietly(send: Callable, *args) -> None:
    """Answer a stream that may be broken itself: its failure must not reach the loop."""
    try:
        send(*args)
    except Exception:
        pass
