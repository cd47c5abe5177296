"""The frontend's own Prometheus metrics, served at /metrics together with the core model's (tritonserver's metrics
port): one endpoint holds everything a scraper wants, the inference gateway's endpoint picker included (it reads
the pool's target port, this one)."""
import httpx
from prometheus_client import CollectorRegistry, Counter, generate_latest

REGISTRY = CollectorRegistry()
REQUESTS = Counter("lora_llm_openai_requests", "OpenAI API requests by endpoint and HTTP status",
                   ["endpoint", "status"], registry=REGISTRY)
UPLOADS = Counter("lora_llm_openai_adapter_uploads", "Adapter weights sent to the core model, by adapter name",
                  ["adapter"], registry=REGISTRY)


class RequestCounter:
    """Counts every API response by path and status (ASGI middleware)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            return await self.app(scope, receive, send)

        async def counted(message):
            if message["type"] == "http.response.start":
                REQUESTS.labels(scope["path"], str(message["status"])).inc()
            await send(message)
        return await self.app(scope, receive, counted)


class CoreMetrics:
    """The core's metrics page (tritonserver's metrics port), read through one HTTP client kept for the app's life:
    a client made per call costs ~20 ms of CPU (its TLS context), which /health would pay on every poll."""

    def __init__(self, url: str | None):
        self.url = url
        self.client = httpx.AsyncClient(timeout=1.0) if url else None

    async def text(self) -> str | None:
        """The page, or None when there is none or it does not answer within a second."""
        if self.client is None:
            return None
        try:
            return (await self.client.get(self.url)).text
        except httpx.HTTPError:
            return None

    async def exposition(self) -> bytes:
        """Ours, then the core's when it answers within a second."""
        core = await self.text()
        return generate_latest(REGISTRY) + (core.encode() if core is not None else b"")

    async def close(self) -> None:
        if self.client is not None:
            await self.client.aclose()
