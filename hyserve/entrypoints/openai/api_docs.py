"""What /openapi.json declares beyond the request models: the response bodies and every status code the
server can answer, all errors in the OpenAI error shape (`ErrorResponse`). FastAPI's default 422
validation body is never sent (validation errors are 400s), so it is taken out of the document. Bounds
that depend on the served model (token ids below the vocabulary size, max_tokens below the context
length, the names the model is served by) are filled in once the engine runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, Field

from hyserve.entrypoints.openai.protocol import ErrorResponse, UsageInfo
from hyserve.entrypoints.strict_models import BOUND_KEY

# ---- response bodies (documentation only: handlers build dicts, which these describe) ----------------


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = Field(description="stop, length or abort")
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: list[dict[str, Any] | None] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo


class ChatMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int
    message: ChatMessage
    logprobs: dict[str, Any] | None = None
    finish_reason: str = Field(description="stop, length, tool_calls or abort")
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: list[dict[str, Any] | None] | None = None


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str


# ---- status codes per route -----------------------------------------------------------------------

_ERRORS = {
    400: "Invalid request: a field out of range, of the wrong JSON type, too deeply nested, or a value the "
         "server cannot serve (a prompt longer than the context, an invalid grammar, malformed messages).",
    401: "Missing or wrong API key (only when the server runs with --api-key).",
    404: "The model is not served here.",
    413: "The request body is too large.",
    500: "The engine failed on this request.",
    503: "The engine is not running (the server exits so that its supervisor restarts it), or the waiting "
         "queue is full (--max-waiting-requests, with Retry-After).",
    529: "The waiting queue is full (--max-waiting-requests, with Retry-After): Anthropic's overloaded_error.",
}
# OpenAPI 3.1 reads an event stream's `schema` as the schema of one event.
_SSE = {"text/event-stream": {"schema": {
    "type": "object", "required": ["data"],
    "properties": {"data": {"type": "string", "contentMediaType": "application/json",
                            "description": "one chunk or event of the answer (JSON), an error object, or (chat "
                                           "and completions) the final `[DONE]`"},
                   "event": {"type": "string", "description": "the event's type (Responses and Messages APIs)"}},
}}}


def errors(*codes: int, model: type[BaseModel] = ErrorResponse,
           notes: dict[int, str] | None = None) -> dict[int | str, dict[str, Any]]:
    """The error answers `codes`, each with a body of `model` (another API's error shape) and `notes`
    saying what a code means on this route where the general description does not."""
    return {c: {"model": model, "description": (notes or {}).get(c) or _ERRORS[c]} for c in codes}


def json_ok(model: type[BaseModel], *, stream: bool = False, what: str = "Success") -> dict[int | str, dict[str, Any]]:
    ok: dict[str, Any] = {"model": model, "description": what + (" (text/event-stream when `stream`)" if stream else "")}
    if stream:
        ok["content"] = dict(_SSE)
    return {200: ok}


GENERATE = errors(400, 401, 404, 413, 500, 503)
TOKENS = errors(400, 401, 404, 413)
HEALTH = {200: {"description": "The engine is running (empty body).", "content": {}}, **errors(503)}
METRICS = {200: {"description": "Prometheus text format.", "content": {"text/plain": {"schema": {"type": "string"}}}}}


def _fill_bounds(node: Any, bounds: dict[str, Any]) -> None:
    """Give every schema marked with BOUND_KEY its bound: a `maximum`, or the `enum` of the names a model
    is served by."""
    stack = [node]
    while stack:
        n = stack.pop()
        if isinstance(n, dict):
            if n.get(BOUND_KEY) in bounds:
                bound = bounds[n.pop(BOUND_KEY)]
                n.update({"enum": bound} if isinstance(bound, list) else {"maximum": bound})
            stack.extend(n.values())
        elif isinstance(n, list):
            stack.extend(n)


def install_openapi(app: FastAPI, bounds: Callable[[], dict[str, Any] | None]) -> None:
    """Generate the document once the engine runs (`bounds()` not None), without FastAPI's 422s."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
        for item in doc.get("paths", {}).values():
            for op in item.values():
                op.get("responses", {}).pop("422", None)
        schemas = doc.get("components", {}).get("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            schemas.pop(name, None)
        known = bounds()
        if known is not None:
            _fill_bounds(doc, known)
            app.openapi_schema = doc
        return doc

    app.openapi = openapi
