"""What /openapi.json declares for the Anthropic Messages API routes: the Message that `serving_messages`
builds (as the official `anthropic` package's `anthropic.types.Message` reads it), the token count, and
every status code each route answers, all errors in Anthropic's shape (`protocol.AnthropicErrorResponse`).
Documentation only: the handlers build dicts, which these describe.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from hyserve.entrypoints.anthropic.protocol import AnthropicErrorResponse
from hyserve.entrypoints.openai import api_docs


class TextContent(BaseModel):
    type: Literal["text"]
    text: str


class ThinkingContent(BaseModel):
    type: Literal["thinking"]
    thinking: str
    signature: str = Field(description="a digest of the thinking: send the block back unchanged")


class ToolUseContent(BaseModel):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class MessageUsage(BaseModel):
    input_tokens: int = Field(description="prompt tokens not read from the prefix cache")
    output_tokens: int
    cache_read_input_tokens: int = Field(description="prompt tokens read from the prefix cache")
    cache_creation_input_tokens: int


class MessageResponse(BaseModel):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[ThinkingContent | TextContent | ToolUseContent]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None
    stop_sequence: str | None
    usage: MessageUsage


class TokenCount(BaseModel):
    input_tokens: int


_NOTES = {400: "invalid_request_error: a field out of range or of the wrong JSON type, too deeply nested, "
               "invalid text, a kind of block, tool or option this server does not serve, or a prompt "
               "longer than the context.",
          401: "authentication_error: a missing or wrong API key (x-api-key or a bearer token; only with "
               "--api-key).",
          404: "not_found_error: the model is not served here.",
          413: "request_too_large: the request body is too large.",
          500: "api_error: the engine failed on this request.",
          503: "api_error: the engine is not running (the server exits so that its supervisor restarts it)."}
CREATE = {**api_docs.json_ok(MessageResponse, stream=True, what="A Message; events of the stream (message_start "
                             "... message_stop, ping) as `event`/`data` pairs"),
          **api_docs.errors(400, 401, 404, 413, 500, 503, 529, model=AnthropicErrorResponse, notes=_NOTES)}
COUNT_TOKENS = {**api_docs.json_ok(TokenCount), **api_docs.errors(400, 401, 404, 413, model=AnthropicErrorResponse, notes=_NOTES)}
