"""Answers the streams on a thread of its own, so that the engine steps while the server delivers.

A server's send may block: Triton's Python backend waits for tritonserver to take each response (0.3-1 ms), and a
loop sending in line would leave the engine idle for all of them, every step. One FIFO for every stream keeps each
stream's answers in order and its final answer last. The loop lets at most one step of answers wait (`wait_idle`
before it queues the next step's), so the queue stays bounded by a step's outputs.
"""
import queue
import threading
from typing import Callable

from backend.engine import StepOutput


class Responder:
    """Calls `emit`, `fail` and `cancelled` on the streams in the order they were queued. An `emit` that raises
    answers its stream with an error at once, skips whatever else was queued for it, and reports it through
    `on_broken` (unless that emit was the last), so that the loop stops its rows and then calls `forget`."""

    def __init__(self, on_broken: Callable[[object], None]):
        self.on_broken = on_broken
        self.calls: queue.Queue = queue.Queue()
        self.broken: set = set()                             # streams answered with an error, until forgotten
        self.thread = threading.Thread(target=self._run, name="responder", daemon=True)
        self.thread.start()

    def emit(self, stream, out: StepOutput, batch_index: int, last: bool) -> None:
        self.calls.put((stream, "emit", (out, batch_index, last)))

    def fail(self, stream, message: str) -> None:
        self.calls.put((stream, "fail", (message,)))

    def cancelled(self, stream) -> None:
        self.calls.put((stream, "cancelled", ()))

    def forget(self, stream) -> None:
        """The loop has closed a stream reported broken: nothing more is queued for it."""
        self.calls.put((stream, "forget", ()))

    def wait_idle(self) -> None:
        """Until every answer queued so far has been sent."""
        self.calls.join()

    def stop(self) -> None:
        """Sends what is queued, then ends the thread."""
        self.calls.put(None)
        self.thread.join(timeout=30)

    def _run(self) -> None:
        while True:
            call = self.calls.get()
            try:
                if call is None:
                    return
                self._call(*call)
            finally:
                self.calls.task_done()

    def _call(self, stream, what: str, args: tuple) -> None:
        if what == "forget":
            self.broken.discard(stream)
        elif stream in self.broken:
            return
        elif what == "emit":
            try:
                stream.emit(*args)
            except Exception as exc:                         # a broken sender closes its own stream only
                quietly(stream.fail, f"response failed: {exc}")
                if not args[-1]:                             # not its last: the loop still runs its rows
                    self.broken.add(stream)
                    self.on_broken(stream)
        else:
            quietly(getattr(stream, what), *args)


def quietly(send: Callable, *args) -> None:
    """Answer a stream that may be broken itself: its failure must not reach the caller."""
    try:
        send(*args)
    except Exception:
        pass
