"""A stub's side of its engine process (backend/serving/engine_process.py): found or started, then requests out and
their answers in.

The engine of a model instance is found by a Unix socket named after tritonserver's HTTP port (one server holds it at a
time), the instance and its engine parameters, in a directory only this user can enter: the first stub starts it, a stub
started after one died (or after tritonserver did) connects to it. Answers arrive on one reader thread, which keeps the
heartbeat and the step reports and queues each stream's answers for an answering thread, which calls the server's
streams (backend/serving/loop.py's Stream) in order: a send that blocks delays answers, not the heartbeat. Where the
sends fall behind the engine (one thread's sends through Triton's Python backend fall short of the tokens a GPU makes
for 64 streams: docs/performance.md, "The server path"), the answering thread takes every answer queued and sends each
stream's tokens of several steps in one response (backend/serving/responder.py's `coalesced`, as the engine's responder
does), instead of falling further behind with every step. A third thread asks every `check_period_s` which clients
cancelled and tells the engine.
"""
import hashlib
import json
import os
import queue
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Callable

from backend.core.request import RequestLimits
from backend.processes import python_executable
from backend.serving.channel import Channel, ChannelClosed
from backend.serving.engine_process import server_options
from backend.serving.heartbeat import PERIOD_S, engines_dir
from backend.serving.responder import coalesced, quietly

ROOT = Path(__file__).resolve().parents[2]
ENGINE_SILENT_S = 3 * PERIOD_S + 2.0          # no heartbeat from the engine for this long: it is stuck or gone
CONNECT_PERIOD_S = 0.05


class EngineUnavailable(RuntimeError):
    pass


def socket_path(server_pid: int, instance_name: str, kwargs: dict) -> Path:
    """Where the engine of this instance, with these parameters, listens for the stubs of the tritonserver on this
    HTTP port (or, serving no HTTP, of this tritonserver)."""
    digest = hashlib.sha256(json.dumps([instance_name, kwargs], sort_keys=True).encode()).hexdigest()[:12]
    options = server_options(server_pid)
    serves_http = options.get("allow-http", "true").lower() not in ("false", "0")
    server = f"port{options.get('http-port', '8000')}" if serves_http else f"pid{server_pid}"
    return engines_dir() / f"engine-{server}-{digest}.sock"


def own_region() -> str:
    """This stub's shared memory region with tritonserver (its command line's third word), or ''."""
    try:
        args = Path("/proc/self/cmdline").read_bytes().split(b"\0")
    except OSError:
        return ""
    return args[2].decode() if len(args) > 2 and "triton_python_backend_stub" in args[0].decode() else ""


class EngineClient:
    """The engine of one model instance, seen from its stub. `on_report(StepReport)` is called on the reader thread,
    and `on_broken()` there once the engine's process is gone; streams (with `emit`, `fail`, `cancelled` and
    `is_cancelled`) get their answers there too, each exactly one final answer, also when the engine dies (an
    error). A stream whose `emit` raises (its sender failed) is dropped and its rows stopped in the engine."""

    def __init__(self, engine_kwargs: dict, model_name: str, instance_name: str, *, check_period_s: float = 0.1,
                 steps_behind: int | None = None, on_report: Callable = lambda report: None,
                 on_broken: Callable[[], None] = lambda: None, start_timeout_s: float = 3600.0):
        self.on_report, self.on_broken = on_report, on_broken
        self.check_period_s = check_period_s
        self.streams: dict[int, object] = {}
        self.cancel_sent: set[int] = set()
        self.next_id = 0
        self.lock = threading.Lock()
        self.broken: str | None = None
        self.process: subprocess.Popen | None = None
        server_pid = os.getppid()
        path = socket_path(server_pid, instance_name, engine_kwargs)
        sock = self._connect(path)
        if sock is None:
            self.process = self._start(path, model_name, engine_kwargs, check_period_s, steps_behind)
            sock = self._wait_for(path, start_timeout_s)
        self.channel = Channel(sock)
        self.channel.send(("hello", os.getpid(), server_pid, own_region()))
        reply = self.channel.recv()
        if reply[0] != "ready":
            raise EngineUnavailable(f"the engine process failed to start: {reply[1]}")
        self.limits: RequestLimits = reply[1]
        self.last_beat = time.monotonic()
        self._stopped = threading.Event()
        self.answers: queue.Queue = queue.Queue()
        self.answerer = threading.Thread(target=self._answer, name="answers", daemon=True)
        self.answerer.start()
        self.reader = threading.Thread(target=self._read, name="engine-reader", daemon=True)
        self.reader.start()
        self.asker = threading.Thread(target=self._ask_cancelled, name="cancel-check", daemon=True)
        self.asker.start()

    @property
    def alive(self) -> bool:
        return self.broken is None and time.monotonic() - self.last_beat < ENGINE_SILENT_S

    def submit(self, stream, name: str = "") -> None:
        if self.broken is not None:
            stream.fail(f"engine unavailable: {self.broken}")
            return
        with self.lock:
            stream_id, self.next_id = self.next_id, self.next_id + 1
            self.streams[stream_id] = stream
        if not self._send(("submit", stream_id, stream.requests, name)) and self._end(stream_id) is not None:
            stream.fail(f"engine unavailable: {self.broken or 'its process is gone'}")

    def cancel(self, name: str) -> None:
        self._send(("stop", name))

    def _send(self, message) -> bool:
        try:
            self.channel.send(message)
            return True
        except ChannelClosed:                                # the reader sees the end and answers every stream
            return False

    def close(self) -> None:
        """The model's end: the engine ends by itself once its last stub has said goodbye (another stub may still
        use it: a reload's new instance)."""
        self._stopped.set()
        self._send(("goodbye",))
        self.reader.join(timeout=60)
        self.answerer.join(timeout=60)
        self.channel.close()

    def _connect(self, path: Path) -> socket.socket | None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(str(path))
            return sock
        except OSError:
            sock.close()
            return None

    def _start(self, path: Path, model_name: str, kwargs: dict, check_period_s: float,
               steps_behind: int | None) -> subprocess.Popen:
        """In a session of its own: tritonserver's end, and a signal to its process group, leave it running."""
        cmd = [python_executable(), "-m", "backend.serving.engine_process", "--socket", str(path),
               "--model-name", model_name, "--engine-kwargs", json.dumps(kwargs),
               "--cancellation-check-period-ms", str(check_period_s * 1e3)]
        if steps_behind is not None:
            cmd += ["--responder-steps-behind", str(steps_behind)]
        return subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.DEVNULL,    # its output: tritonserver's log
                                start_new_session=True)

    def _wait_for(self, path: Path, timeout_s: float) -> socket.socket:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if (code := self.process.poll()) is not None:
                raise EngineUnavailable(f"the engine process exited with code {code} before it listened")
            if (sock := self._connect(path)) is not None:
                return sock
            time.sleep(CONNECT_PERIOD_S)
        self.process.kill()
        raise EngineUnavailable(f"the engine process did not listen within {timeout_s:.0f} s")

    def _read(self) -> None:
        try:
            while True:
                received = self.channel.recv()
                answers = []
                for message in received[1] if received[0] == "batch" else [received]:
                    if message[0] == "beat":
                        self.last_beat = time.monotonic()
                    elif message[0] == "report":
                        quietly(self.on_report, message[1])     # figures are not worth a request
                    else:
                        answers.append(message)
                if answers:
                    self.answers.put(answers)
        except ChannelClosed:
            pass
        if not self._stopped.is_set():
            time.sleep(0.2)                                # (its exit code, where it was ours)
            code = self.process.poll() if self.process is not None else None
            self.broken = "the engine process ended" + (f" (exit code {code})" if code is not None else "")
            self.on_broken()
        self.answers.put(None)

    def _answer(self) -> None:
        while (messages := self._queued()) is not None:
            for message in messages:
                self._dispatch(message)
        with self.lock:
            streams, self.streams = list(self.streams.values()), {}
        for stream in streams:
            quietly(stream.fail, f"engine unavailable: {self.broken or 'the model is unloading'}")

    def _queued(self) -> list[tuple] | None:
        """The answers queued, at least one (None at the end, after what came before it): the emits of each run of
        them merged per stream and sequence."""
        if (messages := self.answers.get()) is None:
            return None
        while True:
            try:
                more = self.answers.get_nowait()
            except queue.Empty:
                break
            if more is None:
                self.answers.put(None)                     # the end, once what came before it is answered
                break
            messages += more
        out, run = [], []                                  # run: the emits since the last other message

        def flush() -> None:
            out.extend(("emit", *each) for each in (coalesced(run) if len(run) > 1 else run))
            run.clear()

        for message in messages:
            if message[0] == "emit":
                run.append(message[1:])
            else:
                flush()
                out.append(message)
        flush()
        return out

    def _dispatch(self, message: tuple) -> None:
        op = message[0]
        if op == "emit":
            _, stream_id, out, batch_index, last = message
            stream = self.streams.get(stream_id) if not last else self._end(stream_id)
            if stream is not None and not quietly(stream.emit, out, batch_index, last) and not last:
                self._end(stream_id)                         # its sender failed: the engine stops its rows
                self._send(("cancelled", stream_id))
        elif op == "fail":
            if (stream := self._end(message[1])) is not None:
                quietly(stream.fail, message[2])
        elif op == "cancelled":
            if (stream := self._end(message[1])) is not None:
                quietly(stream.cancelled)

    def _end(self, stream_id: int):
        with self.lock:
            self.cancel_sent.discard(stream_id)
            return self.streams.pop(stream_id, None)

    def _ask_cancelled(self) -> None:
        """Which clients cancelled (a round trip to tritonserver per stream, off the engine's process)."""
        while not self._stopped.wait(self.check_period_s):
            with self.lock:
                streams = [(i, s) for i, s in self.streams.items() if i not in self.cancel_sent]
            for stream_id, stream in streams:
                try:
                    cancelled = stream.is_cancelled()
                except Exception:                         # its sender is gone: as good as cancelled
                    cancelled = True
                if cancelled:
                    with self.lock:
                        self.cancel_sent.add(stream_id)
                    if not self._send(("cancelled", stream_id)):
                        return
