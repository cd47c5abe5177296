"""The API's ASGI layers and error answers: request bodies past the limit refused before they are read whole (413),
any error no handler answered turned into a 500 in OpenAI's shape, and every error sent as OpenAI's JSON."""
import logging

from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from frontend.errors import OpenAIError

RETRY_AFTER_S = 1                             # a 429's Retry-After: the core's queue drains in steps of ms

log = logging.getLogger("frontend")


def error_response(err: OpenAIError) -> JSONResponse:
    headers = {"Retry-After": str(RETRY_AFTER_S)} if err.status == 429 else None
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


class BodyLimit:
    """Refuses request bodies past max_bytes (413) before they are read whole into memory: by their
    Content-Length, or (chunked) as soon as what arrived passes the limit."""

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            return await error_response(self.too_large(int(length)))(scope, receive, send)
        seen, watched = 0, ResponseWatch(send)

        async def counted():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                raise BodyTooLarge(self.too_large(seen))
            return message
        try:
            await self.app(scope, counted, watched)
        except BodyTooLarge:
            if not watched.started:
                await error_response(self.too_large(seen))(scope, receive, send)

    def too_large(self, num_bytes: int) -> OpenAIError:
        return OpenAIError(413, f"body: a request body of at least {num_bytes} bytes exceeds the limit of "
                                f"{self.max_bytes}", param="body", code="request_too_large")


class ResponseWatch:
    """An ASGI send that notes whether the response has begun: after that, an error can no longer be answered."""

    def __init__(self, send):
        self.send, self.started = send, False

    async def __call__(self, message):
        self.started = self.started or message["type"] == "http.response.start"
        await self.send(message)


class BodyTooLarge(HTTPException):
    """Raised while the body is read; an HTTPException, so that FastAPI passes it on rather than answering a 400."""

    def __init__(self, err: OpenAIError):
        super().__init__(413, err.message)
        self.error = err


class CatchAll:
    """Any error no handler answered becomes a 500 in OpenAI's shape (logged with its traceback, not sent), so that
    the client gets JSON and its keep-alive connection stays usable."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        watched = ResponseWatch(send)
        try:
            await self.app(scope, receive, watched)
        except BodyTooLarge:
            raise
        except Exception:
            log.exception("unexpected error in %s %s", scope.get("method"), scope.get("path"))
            if not watched.started:
                err = OpenAIError(500, "internal error: the server could not answer this request (it is logged)",
                                  "InternalServerError", code="internal_error")
                await error_response(err)(scope, receive, send)
