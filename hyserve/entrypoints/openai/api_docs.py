"""What /openapi.json declares beyond the request models: the response bodies and every status code the
server can answer, all errors in the OpenAI error shape (`ErrorResponse`). FastAPI's default 422
validation body is never sent (validation errors are 400s), so it is taken out of the document.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, Field

from hyserve.entrypoints.openai.protocol import ErrorResponse, UsageInfo

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
}
_SSE = {"text/event-stream": {"schema": {"type": "string", "description": "Server-sent events: JSON chunks, "
                                                                          "then `data: [DONE]`"}}}


def errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    return {c: {"model": ErrorResponse, "description": _ERRORS[c]} for c in codes}


def json_ok(model: type[BaseModel], *, stream: bool = False) -> dict[int | str, dict[str, Any]]:
    ok: dict[str, Any] = {"model": model, "description": "Success" + (" (text/event-stream when `stream`)" if stream else "")}
    if stream:
        ok["content"] = dict(_SSE)
    return {200: ok}


GENERATE = errors(400, 401, 404, 413, 500, 503)
TOKENS = errors(400, 401, 404, 413)
HEALTH = {200: {"description": "The engine is running (empty body).", "content": {}}, **errors(503)}
METRICS = {200: {"description": "Prometheus text format.", "content": {"text/plain": {"schema": {"type": "string"}}}}}


def install_openapi(app: FastAPI) -> None:
    """Generate the document once, without FastAPI's 422 responses and their schemas."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
            for item in doc.get("paths", {}).values():
                for op in item.values():
                    op.get("responses", {}).pop("422", None)
            schemas = doc.get("components", {}).get("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):
                schemas.pop(name, None)
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi
