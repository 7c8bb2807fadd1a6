"""Pure ASGI middleware (not BaseHTTPMiddleware, so streaming responses and disconnect detection pass
through untouched): X-Request-Id echo, the API key, and the request body size limit."""

from __future__ import annotations

from starlette.exceptions import HTTPException as StarletteHTTPException

from hyserve.entrypoints.openai.errors import error_json
from hyserve.entrypoints.openai.limits import MAX_BODY_BYTES

# Paths that need the API key; health, version and metrics stay open for probes and scrapers (as vLLM).
_PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")


class RequestIdAndAuth:
    """ASGI middleware: echo X-Request-Id, and check the API key (a bearer token, or Anthropic's x-api-key). Pure ASGI (not BaseHTTPMiddleware),
    so streaming responses and disconnect detection pass through untouched."""

    def __init__(self, app, api_key: str | None) -> None:
        self.app, self.api_key = app, api_key

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        request_id = headers.get(b"x-request-id")
        extra = {"x-request-id": request_id.decode("latin-1")} if request_id else {}
        if self.api_key and scope["path"].startswith(_PROTECTED_PREFIXES):
            auth = headers.get(b"authorization", b"").decode("latin-1")
            # Anthropic's clients send the key as `x-api-key`, OpenAI's as a bearer token: either will do.
            if auth != f"Bearer {self.api_key}" and headers.get(b"x-api-key", b"").decode("latin-1") != self.api_key:
                answer = error_json(scope["path"], 401, "Invalid or missing API key.", extra)
                return await answer(scope, receive, send)
        length = headers.get(b"content-length", b"0")
        if length.isdigit() and int(length) > MAX_BODY_BYTES:
            return await error_json(scope["path"], 413, _too_large(int(length)), extra)(scope, receive, send)
        receive = _limited(receive)

        async def send_with_id(message) -> None:
            if request_id and message["type"] == "http.response.start":
                message = dict(message)
                message["headers"] = list(message.get("headers") or []) + [(b"x-request-id", request_id)]
            await send(message)

        return await self.app(scope, receive, send_with_id)


def _too_large(size: int | None) -> str:
    got = f" ({size} bytes)" if size is not None else ""
    return f"The request body is too large{got}: the limit is {MAX_BODY_BYTES} bytes."


def _limited(receive):
    """`receive` that refuses a body (sent without Content-Length) once it grows past MAX_BODY_BYTES."""
    seen = 0

    async def inner():
        nonlocal seen
        message = await receive()
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > MAX_BODY_BYTES:
                raise StarletteHTTPException(413, _too_large(None))
        return message

    return inner
