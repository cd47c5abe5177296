"""The OpenAI-compatible HTTP API (FastAPI): completions, chat completions, models, adapters by name, API keys."""
import asyncio
import hmac
import ipaddress
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException

from backend.model.checkpoint import ModelConfig
from backend.serving.heartbeat import engine_health
from frontend.adapters import AdapterStore
from frontend.core import CoreClient
from frontend.errors import OpenAIError, bad_request
from frontend.generation import Generation
from frontend.metrics import CoreMetrics, RequestCounter
from frontend.middleware import BodyLimit, BodyTooLarge, CatchAll, error_response
from frontend.prompts import chat_prompt, completion_prompts
from frontend.responses import DONE, MAX_RESPONSE_BYTES, Responses, estimated_bytes, event, json_pieces
from frontend.sampling import ModelInfo, check_supported, core_arrays, log_probs_asked, max_tokens
from frontend.schemas import (ChatCompletionRequest, CompletionRequest, LoadAdapterRequest, SamplingRequest,
                              UnloadAdapterRequest)
from frontend.tensors import AdapterLimits

COMPLETION_MAX_TOKENS = 16                    # the legacy API's default; chat defaults to what the context leaves
TEXT_THREADS = 2                              # tokenizing and chat templates, off the event loop
LOADING_OFF = ("runtime adapter loading is off: the operator turns it on with --allow-runtime-lora-updating "
               "(or LORA_LLM_ALLOW_RUNTIME_LORA_UPDATING=true) and an admin key")
ERROR_KINDS = {401: "AuthenticationError", 403: "PermissionDeniedError", 404: "NotFoundError", 429: "RateLimitError"}
log = logging.getLogger("frontend")


@dataclass
class FrontendConfig:
    model_dir: str
    grpc_url: str = "127.0.0.1:8001"
    core_model: str = "lora_llm"
    served_model_name: str | None = None      # default: the model directory's name
    adapter_store: str | None = None
    lora_separator: str = "_lora_"
    api_key: str | None = None                # the inference group: completions, chat, models
    admin_key: str | None = None              # the admin group: adapter loading (never the inference key)
    max_body_bytes: int = 8 << 20            # a full context of text or ids, 64 prompts of ids, fits in 4 MB
    adapter_cache_bytes: int = 1 << 30        # adapters held ready to send (fp16 TensorRT-LLM tensors)
    core_metrics_url: str | None = None       # tritonserver's metrics, served with ours at /metrics
    allow_runtime_lora_updating: bool = False # /v1/load_lora_adapter and /v1/unload_lora_adapter answer
    lora_roots: tuple[str, ...] = ()          # folders (besides the store) adapters may be loaded from
    max_lora_rank: int = 64                   # the engine's: adapters are checked against it when loaded
    weight_dtype: str = "auto"                # the engine's: DoRA magnitudes normalize against the weights it serves
    host: str = "127.0.0.1"                   # where the API listens: keys are required off loopback
    warnings: list[str] = field(default_factory=list)

    def __post_init__(self):
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {self.max_body_bytes}")
        if self.adapter_cache_bytes < 0:
            raise ValueError(f"adapter_cache_bytes must be >= 0, got {self.adapter_cache_bytes}")
        if not self.allow_runtime_lora_updating:
            return
        if self.admin_key is not None and self.admin_key == self.api_key:
            raise ValueError("runtime adapter loading needs an admin key distinct from the inference key")
        if not is_loopback(self.host) and (self.admin_key is None or self.api_key is None):
            raise ValueError(f"runtime adapter loading on {self.host}, beyond loopback, needs both keys: "
                             "LORA_LLM_OPENAI_API_KEY and LORA_LLM_OPENAI_ADMIN_KEY (or --api-key-file)")
        if self.api_key is not None and self.admin_key is None:
            raise ValueError("runtime adapter loading needs an admin key (LORA_LLM_OPENAI_ADMIN_KEY or "
                             "--api-key-file's \"admin\") beside the inference key")
        if self.admin_key is None:
            self.warnings.append("runtime adapter loading is on without keys: anyone on this host can load "
                                 "adapters from the store and the allowed roots (for local development only)")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def create_app(config: FrontendConfig) -> FastAPI:
    info = ModelInfo.from_dir(config.model_dir, config.served_model_name)
    limits = AdapterLimits(ModelConfig.from_dir(config.model_dir), config.max_lora_rank, config.model_dir,
                           config.weight_dtype)
    store = AdapterStore(Path(config.adapter_store) if config.adapter_store else None, info.name,
                         config.lora_separator, config.adapter_cache_bytes, limits, config.lora_roots)
    text_threads = ThreadPoolExecutor(TEXT_THREADS, thread_name_prefix="text")
    state: dict = {}
    for warning in config.warnings:
        log.warning(warning)

    @asynccontextmanager
    async def lifespan(app):
        state["core"] = CoreClient(config.grpc_url, config.core_model)
        state["core_metrics"] = CoreMetrics(config.core_metrics_url)
        for line in await asyncio.to_thread(store.prepare):  # the store's adapters ready to send, budget allowing
            log.warning(line)
        yield
        await state["core"].close()
        await state["core_metrics"].close()
        text_threads.shutdown(cancel_futures=True)

    async def off_loop(fn, *args):
        return await asyncio.get_running_loop().run_in_executor(text_threads, fn, *args)

    app = FastAPI(title="lora-llm-triton OpenAI-compatible API", lifespan=lifespan)
    app.add_middleware(CatchAll)
    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes)
    app.add_middleware(RequestCounter)
    inference = Depends(key_check(config.api_key))
    admin = Depends(key_check(config.admin_key))

    @app.exception_handler(OpenAIError)
    async def openai_error(request, err: OpenAIError):
        return error_response(err)

    @app.exception_handler(HTTPException)
    async def http_error(request, err: HTTPException):         # unknown routes, methods, a body past the limit
        if isinstance(err, BodyTooLarge):
            return error_response(err.error)
        kind = ERROR_KINDS.get(err.status_code, "BadRequestError" if err.status_code < 500 else "InternalServerError")
        return error_response(OpenAIError(err.status_code, str(err.detail), kind))

    @app.exception_handler(RequestValidationError)
    async def invalid(request, err: RequestValidationError):
        first = err.errors()[0]
        param = ".".join(str(p) for p in first["loc"][1:]) or "body"
        message = "is not supported (an unknown or unimplemented field)" if first["type"] == "extra_forbidden" \
            else first["msg"]
        return error_response(OpenAIError(400, f"{param}: {message}", param=param))

    @app.get("/health")
    async def health():
        if not await state["core"].ready():
            return PlainTextResponse("core model not ready", status_code=503)
        text = await state["core_metrics"].text()
        why = engine_health(text) if text is not None else None
        return PlainTextResponse(why or "", status_code=503 if why else 200)

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(await state["core_metrics"].exposition(),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models", dependencies=[inference])
    async def models():
        created = int(time.time())
        entry = {"object": "model", "created": created, "owned_by": "lora-llm-triton", "max_model_len": info.max_context}
        data = [entry | {"id": info.name, "root": info.name, "parent": None}]       # names, never server paths
        data += [entry | {"id": a.name, "root": a.name, "parent": info.name} for a in list(store.adapters.values())]
        return {"object": "list", "data": data}

    @app.post("/v1/completions", dependencies=[inference])
    async def completions(req: CompletionRequest, request: Request):
        prompts, texts = await off_loop(completion_prompts, req, info)
        return await serve(request, req, prompts, chat=False, echo=texts if req.echo else None)

    @app.post("/v1/chat/completions", dependencies=[inference])
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        return await serve(request, req, [await off_loop(chat_prompt, req, info)], chat=True)

    @app.post("/v1/load_lora_adapter", dependencies=[admin])
    async def load_adapter(req: LoadAdapterRequest):
        if not config.allow_runtime_lora_updating:
            raise OpenAIError(403, LOADING_OFF, "PermissionDeniedError", code="lora_updating_disabled")
        adapter = await store.load(req.lora_name, req.lora_path)
        log.warning("adapter %r loaded (task id %d)", adapter.name, adapter.task_id)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", dependencies=[admin])
    async def unload_adapter(req: UnloadAdapterRequest):
        if not config.allow_runtime_lora_updating:
            raise OpenAIError(403, LOADING_OFF, "PermissionDeniedError", code="lora_updating_disabled")
        store.unload(req.lora_name)
        log.warning("adapter %r unloaded", req.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")

    async def serve(request: Request, req: SamplingRequest, prompts: list[list[int]], chat: bool,
                    echo: list[str] | None = None):
        adapter = store.resolve(req.model)
        check_supported(req)
        asked = log_probs_asked(req, chat)
        budgets = [max_tokens(req, len(p), info, None if chat else COMPLETION_MAX_TOKENS) for p in prompts]
        check_response_bytes(estimated_bytes(asked, prompts, req.n, budgets, chat), chat)
        arrays = [core_arrays(req, p, budget, info, asked) for p, budget in zip(prompts, budgets)]
        generation = Generation(state["core"], info.tokenizer, prompts, arrays, adapter, req.n, budgets, req.stop,
                                () if req.ignore_eos else info.end_ids)
        responses = Responses(generation, req.model, info.tokenizer, chat, asked)
        prefixes = [text for text in (echo or []) for _ in range(req.n)] or None
        deltas = generation.deltas()
        if not req.stream:
            parts = [[] for _ in generation.choices]
            async for delta in watch(request, deltas):
                parts[delta.index].append(delta)
            payload = await off_loop(responses.whole, parts, generation.usage, prefixes)
            return StreamingResponse(json_pieces(payload), media_type="application/json")     # encoded off the loop
        first = await first_delta(request, deltas)               # errors before any token keep their status
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return EventStream(sse(first, deltas, responses, generation, include_usage, prefixes, off_loop),
                           media_type="text/event-stream")

    return app


def check_response_bytes(estimate: dict[str, int], chat: bool) -> None:
    """Refuse, naming the field that asks for most of it, a response whose log probs would pass MAX_RESPONSE_BYTES."""
    if sum(estimate.values()) > MAX_RESPONSE_BYTES:
        name = max(estimate, key=estimate.get)
        name = "top_logprobs" if chat and name == "logprobs" else name
        raise bad_request(name, f"the log probs asked for would take ~{sum(estimate.values()) >> 20} MiB, past the "
                                f"{MAX_RESPONSE_BYTES >> 20} MiB a response may hold: ask for fewer (k, n, max_tokens, "
                                "or a shorter prompt)")


async def sse(first, deltas, responses: Responses, generation: Generation, include_usage: bool,
              prefixes: list[str] | None, off_loop):
    """The chunks of a stream; a choice's first with its echoed prompt (megabytes of log probs for a long prompt
    with alternatives) is built off the event loop."""
    started = set()
    try:
        delta = first
        while delta is not None:
            echo = False
            if delta.index not in started:
                started.add(delta.index)
                if responses.chat:
                    yield responses.role_chunk(delta.index)
                if prefixes:
                    delta.text, echo = prefixes[delta.index] + delta.text, True
            yield await off_loop(responses.chunk, delta, False, True) if echo else responses.chunk(delta)
            delta = await anext(deltas, None)
        if include_usage:
            yield responses.usage_chunk(generation.usage)
    except OpenAIError as err:                   # after the first token the status is sent: an error event
        yield event(err.body())
    finally:
        await deltas.aclose()
    yield DONE


class EventStream(StreamingResponse):
    """Server-sent events whose generator is closed however the response ends (a client gone included), so that
    its core requests are cancelled at once rather than when it is collected."""

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


async def watch(request: Request, deltas):
    """The deltas until the client disconnects; then the generation is closed (its core requests cancelled)."""
    gone = asyncio.ensure_future(disconnected(request))
    try:
        while True:
            step = asyncio.ensure_future(anext(deltas))
            await asyncio.wait({step, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not step.done():
                step.cancel()
                await asyncio.gather(step, return_exceptions=True)
                await deltas.aclose()
                raise OpenAIError(499, "client closed the request", code="client_closed_request")
            try:
                yield step.result()
            except StopAsyncIteration:
                return
    finally:
        gone.cancel()


async def first_delta(request: Request, deltas):
    watching = watch(request, deltas)
    try:
        return await anext(watching, None)
    finally:
        await watching.aclose()


async def disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def key_check(key: str | None):
    """A dependency that wants `Authorization: Bearer <key>` when the group has a key."""
    async def check(request: Request) -> None:
        if key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise OpenAIError(401, "Incorrect or missing API key (Authorization: Bearer <key>).",
                              "AuthenticationError", code="invalid_api_key")
    return check
