"""Work a request brings that must not run on the engine loop: its adapter's weights parsed on the thread that hands
the request in (its grammar compiles on threads of their own, backend/serving/compiles.py). Parsed adapters wait in the
loop's inbox, and their bytes are bounded by the host tier's budget, so that uploads arriving faster than the engine
takes them cannot grow memory without bound."""
import threading

from backend.core.engine import LLMEngine
from backend.core.request import RequestError
from backend.serving.protocol import ParsedRequest


class Uploads:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.pending_bytes = 0                               # parsed adapters not yet in the engine
        self.lock = threading.Lock()

    def prepare(self, r: ParsedRequest) -> None:
        """Parse the request's adapter (or drop weights the host tier holds already)."""
        lora = r.lora
        if lora is None or lora.weights is None:
            return
        cache = self.engine.lora_cache
        if cache.holds(lora.task_id, lora.weights, lora.config):
            r.lora = lora.parsed(None)                              # the same adapter is cached: the id is enough
            return
        budget = self.engine.config.lora.host_memory_bytes
        if self.pending_bytes + lora.weights.nbytes > budget:
            raise RequestError("lora_weights", f"adapter uploads waiting for the engine exceed "
                                               f"lora_cache_host_memory_bytes {budget}; retry later")
        r.lora = lora.parsed(cache.parse(lora.weights, lora.config))
        self._count(r.lora.adapter.num_bytes)

    def release(self, requests: list[ParsedRequest]) -> None:
        """These requests' parsed adapters left the inbox (into the engine, or refused)."""
        for r in requests:
            if r.lora is not None and r.lora.adapter is not None:
                self._count(-r.lora.adapter.num_bytes)

    def _count(self, num_bytes: int) -> None:
        with self.lock:
            self.pending_bytes += num_bytes
