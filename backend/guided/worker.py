"""Grammars compiled in worker processes, each compile bounded in time and memory and stopped when its request is.

A JSON schema nested a few hundred deep takes xgrammar tens of seconds and gigabytes to compile; in the server's
process that stalls whoever waits on it and can take the machine's memory. Here a compile runs in a process of its
own (`python -m backend.guided.worker TOKENIZER_DIR VOCAB_SIZE`, which ends when its parent does), sends back the
compiled grammar serialized, and is killed (its worker replaced) when it passes `time_limit_s`, `memory_limit_bytes`
(what the worker grew by: it starts at ~360 MB with its tokenizer) or its request's cancellation. Messages are a
length, 8 bytes, then UTF-8 JSON.
"""
import heapq
import json
import os
import select
import struct
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Callable

from backend.core.request import RequestError
from backend.processes import exit_with_parent, python_executable

ROOT = Path(__file__).resolve().parents[2]   # the repository: where `-m backend.guided.worker` runs
POLL_S = 0.02                                 # how often a waiting compile looks at its clock, memory and request
START_LIMIT_S = 120.0                         # a worker's start (its tokenizer loaded), not counted in a compile's
NICE = 10                                     # below the engine: a compile, and a worker's start, take no step's core
CACHE_BYTES = 256 << 20                       # compiled grammars kept for reuse; the least recently used go first
MAX_REFUSED = 4096                            # grammars refused for their cost, refused again at once when resent


class TooCostly(RequestError):
    """A grammar refused for what its compile took: time, memory, or the worker itself."""


class GrammarWorkers:
    """compile(guide_type, guide, cancelled) -> xgrammar.CompiledGrammar, from up to `max_workers` processes at once;
    a compile that finds none idle waits for one (only guided requests ever wait here), the shortest guide first, so
    that a small grammar does not queue behind large ones that will run to the time limit. A grammar found before,
    or refused before for its cost, is answered at once. A killed worker is replaced at once: its successor starts
    while the next compile waits."""

    def __init__(self, tokenizer_dir: str, vocab_size: int, tokenizer_info, time_limit_s: float = 5.0,
                 memory_limit_bytes: int = 512 << 20, max_workers: int = 2):
        import xgrammar
        self.xgr, self.info = xgrammar, tokenizer_info
        self.args = [str(tokenizer_dir), str(vocab_size)]
        self.time_limit_s, self.memory_limit_bytes = time_limit_s, memory_limit_bytes
        self.idle: list[subprocess.Popen] = []
        self.started: set[int] = set()                        # pids of the workers that said they are ready
        self.num_free = max_workers
        self.waiting: list[tuple[int, int]] = []              # heap of (guide length, arrival) waiting for a worker
        self.num_arrived = 0
        self.lock = threading.Lock()
        self.freed = threading.Condition(self.lock)
        self.cache: OrderedDict[tuple[str, str], object] = OrderedDict()
        self.cache_bytes = 0
        self.refused: OrderedDict[tuple[str, str], str] = OrderedDict()     # grammar -> why
        self.idle.append(self._spawn())                       # warm: its start-up overlaps the engine's

    def compile(self, guide_type: str, guide: str, cancelled: Callable[[], bool] = lambda: False):
        key = (guide_type, guide)
        with self.lock:
            if key in self.cache:
                self.cache.move_to_end(key)
                return self.cache[key]
            if key in self.refused:
                raise RequestError("guided_decoding_guide", self.refused[key])
        self._take_worker(len(guide), cancelled)
        try:
            with self.lock:
                worker = self.idle.pop() if self.idle else None
            worker = worker if worker is not None and worker.poll() is None else self._spawn()
            try:
                reply = self._ask(worker, guide_type, guide, cancelled)
            except BaseException as err:
                self._kill(worker)
                with self.lock:
                    self.idle.append(self._spawn())            # its successor starts now, not in the next compile
                    if isinstance(err, TooCostly):
                        self._remember_refused(key, err.message)
                raise
            with self.lock:
                self.idle.append(worker)
        finally:
            with self.lock:
                self.num_free += 1
                self.freed.notify_all()
        if "error" in reply:
            raise RequestError("guided_decoding_guide", f"does not compile as {guide_type}: {reply['error']}")
        grammar = self.xgr.CompiledGrammar.deserialize_json(reply["grammar"], self.info)
        self._remember(key, grammar)
        return grammar

    def _take_worker(self, guide_len: int, cancelled: Callable[[], bool]) -> None:
        """Wait until a worker is free and no shorter guide waits for one."""
        with self.lock:
            ticket = (guide_len, self.num_arrived)
            self.num_arrived += 1
            heapq.heappush(self.waiting, ticket)
            try:
                while not (self.num_free and self.waiting[0] == ticket):
                    self.freed.wait(POLL_S * 5)
                    if cancelled():
                        raise RequestError("guided_decoding_guide", "the request was cancelled while its grammar "
                                                                    "waited to compile")
            finally:
                self.waiting.remove(ticket)
                heapq.heapify(self.waiting)
                self.freed.notify_all()
            self.num_free -= 1

    def _remember_refused(self, key: tuple[str, str], why: str) -> None:
        self.refused[key] = why
        if len(self.refused) > MAX_REFUSED:
            self.refused.popitem(last=False)

    def close(self) -> None:
        with self.lock:
            workers, self.idle = self.idle, []
        for worker in workers:
            self._kill(worker)

    def _spawn(self) -> subprocess.Popen:
        env = os.environ | {"GRAMMAR_WORKER_PARENT": str(os.getpid())}
        return subprocess.Popen([python_executable(), "-m", "backend.guided.worker", *self.args],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env,
                                cwd=ROOT)

    def _ask(self, worker: subprocess.Popen, guide_type: str, guide: str, cancelled: Callable[[], bool]) -> dict:
        if worker.pid not in self.started:                      # its start is not the compile's time, nor memory
            self._wait(worker, START_LIMIT_S, cancelled, "the grammar compiler did not start", bounded=False)
            if read_message(worker.stdout) != {"ready": True}:
                raise RequestError("guided_decoding_guide", "the grammar compiler did not start")
            self.started.add(worker.pid)
        write_message(worker.stdin, {"guide_type": guide_type, "guide": guide})
        self._wait(worker, self.time_limit_s, cancelled, f"its compile passed guided_decoding_compile_timeout_s "
                                                         f"{self.time_limit_s:g}: the grammar is refused")
        reply = read_message(worker.stdout)
        if reply is None:
            raise TooCostly("guided_decoding_guide", "its compile ended the worker: the grammar is refused")
        return reply

    def _wait(self, worker: subprocess.Popen, limit_s: float, cancelled: Callable[[], bool], late: str,
              bounded: bool = True) -> None:
        """Until the worker has something to say: refused past limit_s, its request's cancel, or (bounded) the
        memory bound."""
        started, fd, idle_bytes = time.monotonic(), worker.stdout.fileno(), resident_bytes(worker.pid)
        while not select.select([fd], [], [], POLL_S)[0]:
            if worker.poll() is not None:
                raise (TooCostly if bounded else RequestError)(
                    "guided_decoding_guide", f"its compile ended the worker ({worker.returncode}): the grammar is refused")
            if time.monotonic() - started > limit_s:
                raise (TooCostly if bounded else RequestError)("guided_decoding_guide", late)
            if bounded and resident_bytes(worker.pid) - idle_bytes > self.memory_limit_bytes:
                raise TooCostly("guided_decoding_guide", f"its compile passed guided_decoding_compile_memory_bytes "
                                                         f"{self.memory_limit_bytes}: the grammar is refused")
            if cancelled():
                raise RequestError("guided_decoding_guide", "the request was cancelled while its grammar compiled")

    def _kill(self, worker: subprocess.Popen) -> None:
        if worker.poll() is None:
            worker.kill()
        worker.wait()
        self.started.discard(worker.pid)
        for pipe in (worker.stdin, worker.stdout):
            pipe.close()

    def _remember(self, key: tuple[str, str], grammar) -> None:
        size = grammar.memory_size_bytes
        with self.lock:
            if key in self.cache or size > CACHE_BYTES:
                return
            self.cache[key] = grammar
            self.cache_bytes += size
            while self.cache_bytes > CACHE_BYTES:
                self.cache_bytes -= self.cache.popitem(last=False)[1].memory_size_bytes


def resident_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError):
        return 0


def write_message(pipe, message: dict) -> None:
    data = json.dumps(message).encode()
    pipe.write(struct.pack("<Q", len(data)) + data)
    pipe.flush()


def read_message(pipe) -> dict | None:
    head = pipe.read(8)
    if len(head) < 8:
        return None
    return json.loads(pipe.read(struct.unpack("<Q", head)[0]))


def serve(tokenizer_dir: str, vocab_size: int) -> None:
    import xgrammar

    from backend.text import tokenizer_from_dir
    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer_from_dir(tokenizer_dir), vocab_size=vocab_size)
    compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    compile_as = {"json": lambda _: compiler.compile_builtin_json_grammar(),
                  "json_schema": compiler.compile_json_schema, "regex": compiler.compile_regex,
                  "ebnf_grammar": compiler.compile_grammar}
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    write_message(stdout, {"ready": True})
    while (request := read_message(stdin)) is not None:
        try:
            grammar = compile_as[request["guide_type"]](request["guide"])
            write_message(stdout, {"grammar": grammar.serialize_json()})
        except Exception as err:
            write_message(stdout, {"error": str(err).splitlines()[-1][:300] if str(err) else type(err).__name__})


if __name__ == "__main__":
    if os.getppid() != int(os.environ.get("GRAMMAR_WORKER_PARENT", os.getppid())):
        sys.exit(0)                                            # its parent is gone already
    exit_with_parent(0.5)
    os.nice(NICE)
    serve(sys.argv[1], int(sys.argv[2]))
