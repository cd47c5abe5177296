"""Guided requests' grammars compiled on threads of their own, before the requests reach the engine loop: the thread
that hands a request in returns at once, and no other request waits on a compile it did not ask for. Each compile
runs in a bounded worker process (backend/guided/worker.py) and stops when its client cancels or a stop request
names it."""
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from backend.core.engine import LLMEngine
from backend.core.request import RequestError
from backend.serving.responder import client_cancelled, quietly

MAX_COMPILES = 4                              # grammars compiling at once (each waits for one of the workers)


class GrammarCompiles:
    def __init__(self, engine: LLMEngine, on_compiled: Callable[[object, str], None],
                 on_refused: Callable[[object], None]):
        self.engine = engine
        self.on_compiled = on_compiled                      # (stream, name): its grammars are ready
        self.on_refused = on_refused                        # (stream): answered already (an error, or cancelled)
        self.threads = ThreadPoolExecutor(MAX_COMPILES, thread_name_prefix="grammar")
        self.stopped: dict[str, threading.Event] = {}       # client request id -> set when a stop asks for it

    @staticmethod
    def needs(stream) -> bool:
        return any(r.params.guide_type is not None and r.params.grammar is None for r in stream.requests)

    def start(self, stream, name: str) -> None:
        stopped = self.stopped.setdefault(name, threading.Event()) if name else threading.Event()
        self.threads.submit(self._compile, stream, name, stopped)

    def stop(self, name: str) -> bool:
        """Stop the compile of the request with this client request id; False if none is under way."""
        if name not in self.stopped:
            return False
        self.stopped[name].set()
        return True

    def close(self) -> None:
        for stopped in list(self.stopped.values()):
            stopped.set()
        self.threads.shutdown(wait=True)

    def _compile(self, stream, name: str, stopped: threading.Event) -> None:
        def cancelled() -> bool:
            return stopped.is_set() or client_cancelled(stream)
        try:
            for r in stream.requests:
                if r.params.guide_type is not None and r.params.grammar is None:
                    r.params.grammar = self.engine.compile_guide(r.params, cancelled)
        except Exception as err:
            self.on_refused(stream)
            if cancelled():
                quietly(stream.cancelled)
            else:
                quietly(stream.fail, str(err) if isinstance(err, RequestError) else f"request failed: {err}")
            return
        finally:
            if name and self.stopped.get(name) is stopped:
                del self.stopped[name]
        self.on_compiled(stream, name)
