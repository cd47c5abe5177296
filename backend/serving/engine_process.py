"""The engine in a process of its own, out of the reach of the Triton model's stub.

Tritonserver 2.51 passes a few impossible input shapes on to the Python backend, whose stub dies building their
arrays before `model.py` sees them (docs/reliability.md). With the engine inside the stub, each such request cost a
model load and every request in flight. Here the engine (model, KV cache, adapter tiers, scheduler, loop) lives in
this process, which the model's first stub starts and every later stub of that model instance connects to
(backend/serving/engine_client.py): a stub that dies costs only its own requests (its streams read as cancelled, so the
loop frees their blocks and adapter pins) and the seconds tritonserver takes to start a new stub, which this process
asks for at once (a reload of the model through tritonserver's HTTP repository API), while the caches stay warm.

Under our supervisor it outlives tritonserver too: the tritonserver the supervisor starts after one died finds its
engine again, named by its HTTP port, with the caches warm. It ends when the last stub says goodbye (the model
unloaded), once tritonserver is gone with no supervisor to start another, once no stub has been connected for
`ORPHAN_S`, or once its loop cannot serve (a tensor-parallel worker lost: the next stub starts a new engine).

A stub that dies with requests in flight leaves their clients waiting forever in tritonserver 2.51 (it never ends
them, and its exit waits for them). Under our supervisor (LORA_LLM_SUPERVISED), that tritonserver is killed instead,
so that those clients see their streams end and the supervisor starts a new one, which finds this engine.
"""
import argparse
import json
import os
import signal
import socket
import sys
import threading
import time
import urllib.request
from pathlib import Path

from backend.processes import parent_of
from backend.serving.channel import Channel, ChannelClosed
from backend.serving.heartbeat import SUPERVISED_VAR, Heartbeat, core_key_headers
from backend.serving.metrics import StepReporter

ORPHAN_S = 90.0                               # with no stub this long, the engine ends (the supervisor's longest
                                              # back-off is 30 s)
RESTARTS_PARAMETER = "stub_restarts"          # the model parameter a reload after a stub's death changes
MAX_OUTBOX = 1 << 16                          # messages queued for a stub that has stopped reading: it is let go


class RemoteStream:
    """A stub's client request as the engine loop sees it (backend/serving/loop.py's Stream): its answers go back over
    the stub's channel. Once the stub is gone, it reads as cancelled, and the loop frees what it held."""

    def __init__(self, stub: "StubConnection", stream_id: int, requests: list):
        self.stub, self.stream_id, self.requests = stub, stream_id, requests
        self.client_cancelled = False

    def is_cancelled(self) -> bool:
        return self.client_cancelled or self.stub.gone

    def emit(self, out, batch_index: int, last: bool) -> None:
        self.stub.send(("emit", self.stream_id, out, batch_index, last))
        if last:
            self.stub.streams.pop(self.stream_id, None)

    def fail(self, message: str) -> None:
        self.stub.send(("fail", self.stream_id, message))
        self.stub.streams.pop(self.stream_id, None)

    def cancelled(self) -> None:
        self.stub.send(("cancelled", self.stream_id))
        self.stub.streams.pop(self.stream_id, None)


class StubConnection:
    """One stub's channel: its requests in, their answers, the step reports and heartbeats out. What goes out is
    queued and sent by a writer thread of its own, everything queued as one message: a step's answers cost one
    pickle and one write, not one for each stream (docs/performance.md, "The engine's own process"), and a stub
    slow to read holds up no thread of the engine's."""

    def __init__(self, host: "EngineHost", channel: Channel):
        self.host, self.channel = host, channel
        self.streams: dict[int, RemoteStream] = {}
        self.gone = False                      # the channel closed (the stub ended or died)
        self.streams_at_loss = 0               # its requests in flight when the engine first found it gone (the
                                               # loop may end them before the reader acts on the loss)
        self.said_goodbye = False              # it ended on purpose (finalize)
        self.region = ""                       # its shared memory region, removed if it dies
        self.pid = self.server_pid = 0
        self.supervisor_pid = 0                # what restarts its tritonserver, if anything does
        self.greeted = False                   # its hello answered: broadcasts (beats, reports) may follow
        self.outbox: list = []
        self.outbox_filled = threading.Condition()

    def send(self, message) -> None:
        with self.outbox_filled:
            if self.gone:
                return
            self.outbox.append(message)
            self.outbox_filled.notify()
            stalled = len(self.outbox) >= MAX_OUTBOX
        if stalled:                            # (its reader thread reads all the time: the stub is stopped or stuck)
            log(f"the stub (pid {self.pid}) has not read {MAX_OUTBOX} messages; its connection is closed")
            self.lose()
            self.channel.close()

    def lose(self) -> None:
        """The channel is found closed: from now on every stream of this stub reads as cancelled."""
        with self.outbox_filled:
            if not self.gone:
                self.streams_at_loss = len(self.streams)
                self.gone = True
                self.outbox = []
                self.outbox_filled.notify()

    def serve(self) -> None:
        try:
            _, self.pid, self.server_pid, self.region = self.channel.recv()
            self.supervisor_pid = parent_of(self.server_pid) if os.environ.get(SUPERVISED_VAR) else 0
            self.channel.send(("ready", self.host.loop.engine.limits))         # alone: the stub waits for it
            threading.Thread(target=self._write, name="stub-writer", daemon=True).start()
            self.send(("report", self.host.reporter.report(self.host.loop.engine, None, self.host.loop.alive)))
            self.greeted = True
            while True:
                self._handle(self.channel.recv())
        except ChannelClosed:
            pass
        finally:
            self.lose()
            self.channel.close()
            self.host.disconnected(self)

    def _write(self) -> None:
        while True:
            with self.outbox_filled:
                self.outbox_filled.wait_for(lambda: self.outbox or self.gone)
                if self.gone:
                    return
                messages, self.outbox = self.outbox, []
            try:
                self.channel.send(("batch", messages) if len(messages) > 1 else messages[0])
            except ChannelClosed:              # the reader sees the end too, and acts on it
                self.lose()
                return

    def _handle(self, message: tuple) -> None:
        op = message[0]
        if op == "submit":
            _, stream_id, rows, name = message
            stream = self.streams[stream_id] = RemoteStream(self, stream_id, rows)
            self.host.loop.submit(stream, name)
        elif op == "cancelled":                # its client cancelled: the loop sees it at its next check
            if (stream := self.streams.get(message[1])) is not None:
                stream.client_cancelled = True
        elif op == "stop":                     # a client's stop request, by request id
            self.host.loop.cancel(message[1])
        elif op == "goodbye":
            self.said_goodbye = True
            raise ChannelClosed("goodbye")


class EngineHost:
    """Accepts stubs on a Unix socket and serves them from one engine loop."""

    def __init__(self, loop, listener: socket.socket, path: Path, model_name: str):
        self.loop, self.listener, self.path, self.model_name = loop, listener, path, model_name
        self.stubs: list[StubConnection] = []
        self.alone_since: float | None = time.monotonic()   # no stub connected since then
        self.successor_expected = True         # False once tritonserver is gone with nothing to start another
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.num_reloads = 0
        self.reporter = StepReporter()
        loop.on_step = self.on_step
        self.heartbeat = Heartbeat(lambda t: self.broadcast(("beat", t)), lambda: loop.alive,
                                   lambda: loop.step_started)

    def serve(self) -> None:
        self.heartbeat.start()
        threading.Thread(target=self._accept, name="accept", daemon=True).start()
        while not self.done.wait(1.0):
            if not self.loop.alive:           # its stubs see it end; a new stub starts a new engine
                log(f"the engine can serve no more ({self.loop.broken}); it ends")
                return
            with self.lock:
                alone = self.alone_since is not None and (time.monotonic() - self.alone_since > ORPHAN_S or
                                                          not self.successor_expected)
            if alone:
                log("tritonserver is gone and nothing starts another; the engine ends" if not self.successor_expected
                    else f"no stub for {ORPHAN_S:.0f} s; the engine ends")
                return

    def on_step(self, engine, seconds: float | None) -> None:
        self.broadcast(("report", self.reporter.report(engine, seconds, self.loop.alive)))

    def broadcast(self, message) -> None:
        """To every stub whose hello is answered: a beat sent before its "ready" read as a failed start."""
        with self.lock:
            stubs = [stub for stub in self.stubs if stub.greeted]
        for stub in stubs:
            stub.send(message)

    def disconnected(self, stub: StubConnection) -> None:
        with self.lock:
            self.stubs.remove(stub)
            if not self.stubs:
                self.alone_since = time.monotonic()
        if stub.said_goodbye:
            if self.alone_since is not None:
                self.done.set()
            return
        remove_region(stub.region)
        if not alive(stub.server_pid):
            self.successor_expected = stub.supervisor_pid > 0 and alive(stub.supervisor_pid)
            if self.successor_expected:
                log(f"tritonserver (pid {stub.server_pid}) is gone; the engine waits for its successor")
        elif stub.streams_at_loss and os.environ.get(SUPERVISED_VAR):
            log(f"the stub (pid {stub.pid}) of model {self.model_name!r} died with {stub.streams_at_loss} requests "
                "in flight, which tritonserver would never end: it is killed, for the supervisor to restart")
            os.kill(stub.server_pid, signal.SIGKILL)
        else:
            log(f"the stub (pid {stub.pid}) of model {self.model_name!r} died with {stub.streams_at_loss} requests "
                "in flight; they are cancelled and the model is reloaded")
            threading.Thread(target=self._reload, args=(stub.server_pid,), name="reload", daemon=True).start()

    def _accept(self) -> None:
        while not self.done.is_set():
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return
            stub = StubConnection(self, Channel(sock))
            with self.lock:
                self.stubs.append(stub)
                self.alone_since = None
                self.successor_expected = True
            threading.Thread(target=stub.serve, name="stub", daemon=True).start()

    def _reload(self, server_pid: int) -> None:
        self.num_reloads += 1
        try:
            reload_model(server_pid, self.model_name, self.num_reloads)
        except Exception as err:              # the heartbeat goes stale: the supervisor restarts tritonserver
            log(f"could not reload model {self.model_name!r}: {type(err).__name__}: {err}")

    def close(self) -> None:
        self.heartbeat.stop()
        self.listener.close()
        self.path.unlink(missing_ok=True)
        self.path.with_suffix(".pid").unlink(missing_ok=True)
        self.loop.stop()
        self.loop.engine.close()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def remove_region(name: str) -> None:
    """A dead stub's shared memory region (tritonserver's Python backend does not remove it)."""
    if name and "/" not in name and name not in (".", ".."):
        Path("/dev/shm", name).unlink(missing_ok=True)


def server_options(server_pid: int) -> dict[str, str]:
    """tritonserver's command-line options (--name=value or --name value)."""
    args = Path(f"/proc/{server_pid}/cmdline").read_bytes().decode().split("\0")
    options, key = {}, None
    for arg in args[1:]:
        if arg.startswith("--"):
            key, _, value = arg[2:].partition("=")
            options[key] = value
            key = None if value else key
        elif key is not None:
            options[key], key = arg, None
    return options


def http_endpoint(server_pid: int) -> str:
    """tritonserver's HTTP address, from its command line; raises where it serves no HTTP."""
    options = server_options(server_pid)
    if options.get("allow-http", "true").lower() in ("false", "0"):
        raise RuntimeError("tritonserver serves no HTTP (--allow-http false)")
    address = options.get("http-address", "0.0.0.0")
    return f"{'127.0.0.1' if address in ('0.0.0.0', '') else address}:{options.get('http-port', '8000')}"


def reload_model(server_pid: int, model_name: str, generation: int) -> None:
    """Ask tritonserver for a new stub: a load of the model with its own config and one parameter changed (a load
    of an unchanged model does nothing). Needs model control mode explicit, as our launcher starts it."""
    base = f"http://{http_endpoint(server_pid)}/v2"
    headers = core_key_headers()                         # where its ports ask for a key
    request = urllib.request.Request(f"{base}/models/{model_name}/config", headers=headers)
    with urllib.request.urlopen(request, timeout=10) as response:
        config = json.loads(response.read())
    config.setdefault("parameters", {})[RESTARTS_PARAMETER] = {"string_value": str(generation)}
    body = json.dumps({"parameters": {"config": json.dumps(config)}}).encode()
    request = urllib.request.Request(f"{base}/repository/models/{model_name}/load", data=body, method="POST",
                                     headers=headers | {"Content-Type": "application/json"})
    started = time.monotonic()
    with urllib.request.urlopen(request, timeout=600) as response:
        response.read()
    log(f"model {model_name!r} reloaded in {time.monotonic() - started:.1f} s")


def log(line: str) -> None:
    print(f"[engine {os.getpid()}] {line}", file=sys.stderr, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--socket", type=Path, required=True)
    parser.add_argument("--model-name", required=True)
    parser.add_argument("--engine-kwargs", type=json.loads, required=True)
    parser.add_argument("--cancellation-check-period-ms", type=float, default=100)
    parser.add_argument("--responder-steps-behind", type=int, default=None)
    args = parser.parse_args()
    signal.signal(signal.SIGINT, signal.SIG_IGN)       # a ^C to the terminal's group is tritonserver's to handle
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    args.socket.unlink(missing_ok=True)
    listener.bind(str(args.socket))
    listener.listen(8)                                  # the first stub waits here while the engine starts
    args.socket.with_suffix(".pid").write_text(str(os.getpid()))
    try:
        loop = start_engine(args)
    except BaseException as err:                        # told to the stub that waits, then the end
        fail_waiting_stub(listener, f"{type(err).__name__}: {err}")
        args.socket.unlink(missing_ok=True)
        args.socket.with_suffix(".pid").unlink(missing_ok=True)
        raise
    host = EngineHost(loop, listener, args.socket, args.model_name)
    signal.signal(signal.SIGTERM, lambda *_: host.done.set())    # (scripts/server_process.stop_server)
    try:
        host.serve()
    finally:
        host.close()


def start_engine(args):
    from backend.core.engine import LLMEngine
    from backend.serving.responder import STEPS_BEHIND
    from backend.serving.loop import EngineLoop
    kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in args.engine_kwargs.items()}
    engine = LLMEngine(**kwargs)
    runner = engine.runner
    lm_head = "" if engine.config.lm_head_dtype == "auto" else f", LM head {engine.config.lm_head_dtype}"
    beside = "" if runner.projection_dtype == runner.dtype else \
        f", {str(runner.projection_dtype).removeprefix('torch.')} where not quantized"
    log(f"weights {runner.weight_bytes / 2**20:.1f} MiB ({engine.config.weight_dtype}{lm_head}{beside}, "
        f"{str(runner.dtype).removeprefix('torch.')} activations), KV cache {runner.num_blocks} blocks "
        f"({engine.config.kv_cache_dtype}: {str(runner.kv_cache_dtype).removeprefix('torch.')}), kernels "
        f"{runner.kernel_backend} on {runner.device}")
    return EngineLoop(engine, cancellation_check_period_s=args.cancellation_check_period_ms / 1e3,
                      max_steps_behind=args.responder_steps_behind or STEPS_BEHIND)


def fail_waiting_stub(listener: socket.socket, message: str) -> None:
    listener.settimeout(5)
    try:
        sock, _ = listener.accept()
    except OSError:
        return
    channel = Channel(sock)
    try:
        channel.recv()
        channel.send(("failed", message))
    except ChannelClosed:
        pass
    channel.close()


if __name__ == "__main__":
    main()
