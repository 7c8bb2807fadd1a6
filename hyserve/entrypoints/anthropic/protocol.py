"""Request models and errors of the Anthropic Messages API, after the official `anthropic` package's
`anthropic.types` (MessageCreateParams, the content block params, the error objects).

Strict as the vendor's API is: no string is coerced to a number or a bool. Unknown fields are ignored;
blocks, tools and options of a kind this server does not serve validate as `Unsupported` so that the
handler can refuse them by name. Errors have Anthropic's shape, type names and status codes:
`{"type": "error", "error": {"type": "invalid_request_error", "message": "..."}}`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from hyserve.entrypoints.openai.protocol import APIError
from hyserve.entrypoints.strict_models import Strict, tagged_union

TOOL_NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,128}$"
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 402: "billing_error",
               403: "permission_error", 404: "not_found_error", 413: "request_too_large",
               429: "rate_limit_error", 500: "api_error", 504: "timeout_error", 529: "overloaded_error"}
OVERLOADED = 529


# ---- content blocks ---------------------------------------------------------------------------------


class TextBlock(Strict):
    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None  # accepted: the prefix cache is automatic
    citations: list[dict[str, Any]] | None = None


class ToolUseBlock(Strict):
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None


ResultPart = tagged_union((TextBlock, "text"))


class ToolResultBlock(Strict):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: str | list[ResultPart] | None = None
    is_error: bool | None = None
    cache_control: dict[str, Any] | None = None


class ThinkingBlock(Strict):
    type: Literal["thinking"]
    thinking: str
    signature: str


ContentBlock = tagged_union((TextBlock, "text"), (ToolUseBlock, "tool_use"), (ToolResultBlock, "tool_result"),
                      (ThinkingBlock, "thinking"))


class Message(Strict):
    role: Literal["user", "assistant", "system"]
    content: str | list[ContentBlock]


# ---- tools and options ------------------------------------------------------------------------------


class Tool(Strict):
    type: Literal["custom"] | None = None
    name: str = Field(pattern=TOOL_NAME_PATTERN)
    description: str | None = None
    input_schema: dict[str, Any]
    cache_control: dict[str, Any] | None = None
    strict: bool | None = None


AnyTool = tagged_union((Tool, "custom"), default="custom")


class ToolChoiceAuto(Strict):
    type: Literal["auto"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceAny(Strict):
    type: Literal["any"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceTool(Strict):
    type: Literal["tool"]
    name: str = Field(min_length=1)
    disable_parallel_tool_use: bool | None = None


class ToolChoiceNone(Strict):
    type: Literal["none"]


ToolChoice = tagged_union((ToolChoiceAuto, "auto"), (ToolChoiceAny, "any"), (ToolChoiceTool, "tool"),
                    (ToolChoiceNone, "none"))


class ThinkingEnabled(Strict):
    type: Literal["enabled"]
    budget_tokens: int = Field(ge=1024)
    display: Literal["summarized", "omitted"] | None = None


class ThinkingDisabled(Strict):
    type: Literal["disabled"]


class ThinkingAdaptive(Strict):
    type: Literal["adaptive"]
    display: Literal["summarized", "omitted"] | None = None


Thinking = tagged_union((ThinkingEnabled, "enabled"), (ThinkingDisabled, "disabled"), (ThinkingAdaptive, "adaptive"))


class JSONOutputFormat(Strict):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(Strict):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: JSONOutputFormat | None = None


class Metadata(Strict):
    user_id: str | None = Field(default=None, max_length=256)


class CountTokensRequest(Strict):
    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[AnyTool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
    container: Any = None  # refused when given: no code-execution containers here
    mcp_servers: Any = None  # refused when given: no server-side MCP connector here


# ---- errors -----------------------------------------------------------------------------------------


class ErrorObject(BaseModel):
    type: str
    message: str


class ErrorResponse(BaseModel):
    type: Literal["error"] = "error"
    error: ErrorObject


def error_body(status: int, message: str) -> dict[str, Any]:
    kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return ErrorResponse(error=ErrorObject(type=kind, message=message)).model_dump()


def from_api_error(e: APIError) -> tuple[int, dict[str, Any], dict[str, str] | None]:
    """(status, body, headers) of a chat-path error in Anthropic's terms: a full queue is 529 overloaded."""
    status = e.status
    if status == 503 and e.headers and "Retry-After" in e.headers:
        status = OVERLOADED
    message = f"{e.param}: {e.message}" if e.param and e.param not in e.message else e.message
    return status, error_body(status, message), e.headers
