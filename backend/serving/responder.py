"""Answers the streams on a thread of its own, so that the engine steps while the server delivers.

A server's send may block: Triton's Python backend waits for tritonserver to take each response, and a
loop sending in line would leave the engine idle for all of them, every step. One FIFO for every stream keeps each
stream's answers in order and its final answer last. The loop lets a few steps of answers wait (`wait_behind` before
it queues the next step's), so the queue stays bounded by a few steps' outputs. Where the sends fall behind the
engine, the steps queued are sent together: one response a stream, with the tokens of all of them (`coalesced`), so
that a message's cost is paid once for several tokens instead of holding the engine back.

Asking whether a client cancelled is a round trip too (one a stream in Triton), and where the loop lets it
(EngineLoop's `ask_on_responder`) the responder asks, one stream at a time while no answer waits: the streams it
has not yet answered finally, which no other thread sends on, so none is asked after its final answer (that
crashes tritonserver).
"""
import queue
import threading
from typing import Callable

from backend.core.outputs import StepOutput, TokenRow, as_output, merged

Emit = tuple[object, StepOutput | TokenRow, int, bool]        # (stream, output, batch index, the stream's last)
STEPS_BEHIND = 1              # the loop's default (model parameter responder_steps_behind): 1 while tritonserver 2.51
                              # can crash when a client's cancel meets a final response (#7368); with 4 the soak's
                              # tritonserver died of SIGSEGV once, a final response then carrying several tokens


class Responder:
    """Calls `emit`, `fail` and `cancelled` on the streams in the order they were queued. An `emit` that raises
    answers its stream with an error at once, skips whatever else was queued for it, and reports it through
    `on_broken` (unless that emit was the last), so that the loop stops its rows and then calls `forget`.
    After `check_cancellations`, each stream `watch`ed and not yet answered finally is asked `is_cancelled` once;
    one that says so (or cannot tell) goes to `on_cancelled`, and is asked no more."""

    def __init__(self, on_broken: Callable[[object], None], on_cancelled: Callable[[object], None] = lambda s: None):
        self.on_broken = on_broken
        self.on_cancelled = on_cancelled
        self.calls: queue.Queue = queue.Queue()
        self.broken: set = set()                             # streams answered with an error, until forgotten
        self.watched: dict = {}                              # streams without their final answer, oldest first
        self.to_ask: list = []                               # what is left of the last check, next last
        self.held: list = []                                 # a call taken while gathering queued steps: next
        self.steps_queued = 0                                # emit calls not yet sent
        self.sent = threading.Condition()
        self.thread = threading.Thread(target=self._run, name="responder", daemon=True)
        self.thread.start()

    def emit(self, emits: list[Emit]) -> None:
        """Queue a step's outputs, (stream, output, batch index, last) each in order, as one call: a queue operation
        (and a wake-up of this thread) a step, not one a token. A token row is made a StepOutput here, on the
        responder's thread."""
        if emits:
            with self.sent:
                self.steps_queued += 1
            self.calls.put((None, "emit", emits))

    def wait_behind(self, num_steps: int) -> None:
        """Until at most `num_steps` steps of answers are queued and not yet sent."""
        with self.sent:
            self.sent.wait_for(lambda: self.steps_queued <= num_steps)

    def fail(self, stream, message: str) -> None:
        self.calls.put((stream, "fail", (message,)))

    def cancelled(self, stream) -> None:
        self.calls.put((stream, "cancelled", ()))

    def forget(self, stream) -> None:
        """The loop has closed a stream reported broken: nothing more is queued for it."""
        self.calls.put((stream, "forget", ()))

    def watch(self, stream) -> None:
        """A stream the loop serves: ask it at each check until its final answer."""
        self.calls.put((stream, "watch", ()))

    def check_cancellations(self) -> None:
        """Ask every watched stream once more, between answers."""
        self.calls.put((None, "check", ()))

    def wait_idle(self) -> None:
        """Until every answer queued so far has been sent (a check in progress does not count)."""
        self.calls.join()

    def stop(self) -> None:
        """Sends what is queued, then ends the thread."""
        self.calls.put(None)
        self.thread.join(timeout=30)

    def _run(self) -> None:
        while True:
            call = self._next_call()
            try:
                if call is None:
                    return
                self._call(*call)
            finally:
                self.calls.task_done()

    def _next_call(self):
        """The next queued call; until one comes, the check's next question."""
        if self.held:
            return self.held.pop()
        while self.to_ask:
            try:
                return self.calls.get_nowait()
            except queue.Empty:
                self._ask(self.to_ask.pop())
        return self.calls.get()

    def _ask(self, stream) -> None:
        if stream in self.watched and client_cancelled(stream):
            del self.watched[stream]
            self.on_cancelled(stream)

    def _call(self, stream, what: str, args: tuple) -> None:
        if what == "check":
            self.to_ask = list(reversed(self.watched))
        elif what == "watch":
            self.watched[stream] = None
        elif what == "forget":
            self.broken.discard(stream)
        elif what == "emit":
            emits, num_steps = list(args), 1
            while not self.held:                             # the steps queued behind it, sent with it
                try:
                    call = self.calls.get_nowait()
                except queue.Empty:
                    break
                if call is None or call[1] != "emit":
                    self.held.append(call)                   # answered next, in its place in the order (a stop too)
                    break
                emits += call[2]
                num_steps += 1
                self.calls.task_done()
            try:
                for each in coalesced(emits) if num_steps > 1 else emits:
                    self._emit(*each)
            finally:                                         # the loop waits on this count: never left behind
                with self.sent:
                    self.steps_queued -= num_steps
                    self.sent.notify_all()
        elif stream not in self.broken:                      # fail, cancelled: a final answer
            self.watched.pop(stream, None)
            quietly(getattr(stream, what), *args)

    def _emit(self, stream, out: StepOutput | TokenRow, batch_index: int, final: bool) -> None:
        if stream in self.broken:
            return
        try:
            stream.emit(as_output(out), batch_index, final)
        except Exception as exc:                             # a broken sender closes its own stream only
            quietly(stream.fail, f"response failed: {exc}")
            if not final:                                    # not its last: the loop still runs its rows
                self.broken.add(stream)
                self.on_broken(stream)
            final = True
        if final:
            self.watched.pop(stream, None)


def coalesced(emits: list[Emit]) -> list[Emit]:
    """Several steps' outputs, each stream's together: where all of a stream's are of one sequence and none has
    generation logits or beams (a beam search streams each round's beams), one output with all their tokens
    (`merged`); else its outputs as they were, in order."""
    by_stream: dict = {}
    for each in emits:
        by_stream.setdefault(each[0], []).append(each)
    out = []
    for stream, group in by_stream.items():
        if len(group) > 1:
            outputs = [as_output(each[1]) for each in group]
            if len({(each[2], o.sequence_index) for each, o in zip(group, outputs)}) == 1 and \
                    all(o.generation_logits is None and o.beams is None for o in outputs):
                out.append((stream, merged(outputs), group[0][2], group[-1][3]))
                continue
        out += group
    return out


def client_cancelled(stream) -> bool:
    try:
        return stream.is_cancelled()
    except Exception:                                        # a sender that cannot tell is treated as gone
        return True


def quietly(send: Callable, *args) -> bool:
    """Answer a stream that may be broken itself: its failure must not reach the caller. Whether it went through."""
    try:
        send(*args)
        return True
    except Exception:
        return False
