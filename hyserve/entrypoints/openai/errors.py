"""The server's error answers: every one in the shape of its API (OpenAI's `protocol.ErrorResponse`, on
/v1/messages Anthropic's), validation errors as 400s whose message names the field ("n must be less than
or equal to 16384, got 1000000000")."""

from __future__ import annotations

import logging
from collections.abc import Mapping

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from hyserve.entrypoints.anthropic.protocol import from_api_error
from hyserve.entrypoints.openai.protocol import APIError

log = logging.getLogger("hyserve.server")


def _union_member(part: object) -> bool:
    """A union reports each member it tried (`prompt.str`, `prompt.list[int]`, `TokenizeChatRequest.messages`):
    names of types, never of fields (the API's fields are snake_case)."""
    return isinstance(part, str) and (part[:1].isupper() or any(c in part for c in "[-") or part in _TYPE_TAGS)


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def validation_message(exc: RequestValidationError | ValidationError,
                       rename: Mapping[str, str] | None = None) -> tuple[str, str | None]:
    """(one sentence per error, naming the field: "n must be less than or equal to 16384, got 10**9"; the
    path of the first field named, "text.verbosity"). `rename` says a top-level field in another API's
    words (a Messages request runs as a chat request: chat's `stop` is its `stop_sequences`)."""
    parts, param = [], None
    for err in exc.errors():
        loc = [x for x in err.get("loc", ()) if x != "body" and not _union_member(x)]
        if loc and rename and loc[0] in rename:
            loc = [rename[loc[0]], *loc[1:]]
        ctx = err.get("ctx") or {}
        if err.get("type") == "json_invalid":
            return f"Invalid JSON body: {ctx.get('error', err.get('msg'))}", None
        if "param" in ctx:  # a limits.py refusal: its message names the field
            return str(err.get("msg")), str(ctx["param"])
        path = "".join(f"[{x}]" if isinstance(x, int) else f".{x}" for x in loc).lstrip(".") or "body"
        param = param or (path if loc else None)
        msg = str(err.get("msg"))
        if msg.startswith("Input should be "):
            value = err.get("input")
            got = f", got {value!r}" if isinstance(value, (str, int, float, bool)) and len(repr(value)) < 80 else ""
            parts.append(f"{path} must be {msg[len('Input should be '):]}{got}")
        else:
            parts.append(f"{path}: {msg}")
    return "; ".join(dict.fromkeys(parts)) or "invalid request", param


def is_anthropic(path: str) -> bool:
    """Paths of the Anthropic Messages API, whose errors have Anthropic's shape."""
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def error_response(path: str, err: APIError) -> JSONResponse:
    """`err` answered in the shape of the API that `path` belongs to: Anthropic's on /v1/messages (where a
    full waiting queue is 529 overloaded), OpenAI's everywhere else."""
    if is_anthropic(path):
        status, body, headers = from_api_error(err)
        return JSONResponse(body, status_code=status, headers=headers)
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def error_json(path: str, status: int, message: str, headers: dict | None = None) -> JSONResponse:
    """An error answer in the shape of the API that `path` belongs to."""
    return error_response(path, APIError(status, message, headers=headers))


_METHODS = ("DELETE", "GET", "HEAD", "PATCH", "POST", "PUT")


def _allowed_methods(request: Request) -> str:
    """Every method some route serves at this path: Starlette's 405 names only the first route's (GET of
    /v1/responses/{id}, which DELETE shares)."""
    routes = request.app.router.routes
    return ", ".join(m for m in _METHODS if any(
        r.matches({**request.scope, "method": m})[0] == Match.FULL for r in routes))


def install_error_handlers(app: FastAPI) -> None:
    """Every error in the shape of its API (`error_response`): FastAPI's own (validation, routing, body
    parsing) included."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(request.url.path, exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(request.url.path, APIError(400, *validation_message(exc)))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # Routing (404/405) and body-parsing errors (bad UTF-8, nesting too deep) get the API's error
        # shape too, not FastAPI's {"detail": ...}, so clients can read them like every other error.
        headers = exc.headers
        if exc.status_code == 405:
            headers = {**(headers or {}), "Allow": _allowed_methods(request)}
        return error_response(request.url.path, APIError(exc.status_code, str(exc.detail), headers=headers))

    @app.exception_handler(UnicodeEncodeError)
    async def _unencodable_text(request: Request, exc: UnicodeEncodeError) -> JSONResponse:
        # JSON allows escaped lone surrogates ("\ud800"), which no tokenizer can encode: the client's fault.
        message = f"the request holds text that is not valid Unicode: {exc.reason} at {exc.object[exc.start:exc.end]!r}"
        return error_response(request.url.path, APIError(400, message))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return error_response(request.url.path, APIError(500, f"{type(exc).__name__}: {exc}"))
