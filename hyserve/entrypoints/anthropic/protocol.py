"""Request models and errors of the Anthropic Messages API, after the official `anthropic` package's
`anthropic.types` (MessageCreateParams, the content block params, the error objects).

Strict as the vendor's API is, and held to the same edge limits as every request body (`strict_models`):
no string is coerced to a number or a bool. Unknown fields are ignored; blocks, tools and options of a kind
this server does not serve validate as `Unsupported` so that the handler can refuse them by name, and
fields it cannot honour are refused when given (`refused`). Errors have Anthropic's shape, type names and status codes:
`{"type": "error", "error": {"type": "invalid_request_error", "message": "..."}}`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, Field, WithJsonSchema

from hyserve.entrypoints.openai.protocol import APIError
from hyserve.entrypoints.strict_models import (
    MaxTokens,
    ModelName,
    NonEmptyStr,
    RequestBody,
    StrictModel,
    integer,
    refused,
    tagged_union,
)

TOOL_NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,128}$"
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 402: "billing_error",
               403: "permission_error", 404: "not_found_error", 413: "request_too_large",
               429: "rate_limit_error", 500: "api_error", 504: "timeout_error", 529: "overloaded_error"}
OVERLOADED = 529


# ---- content blocks ---------------------------------------------------------------------------------


class TextBlock(StrictModel):
    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None  # accepted: the prefix cache is automatic
    citations: list[dict[str, Any]] | None = None


class ToolUseBlock(StrictModel):
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None


ResultPart = tagged_union((TextBlock, "text"))


class ToolResultBlock(StrictModel):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: str | list[ResultPart] | None = None
    is_error: bool | None = None
    cache_control: dict[str, Any] | None = None


class ThinkingBlock(StrictModel):
    type: Literal["thinking"]
    thinking: str
    signature: str


ContentBlock = tagged_union((TextBlock, "text"), (ToolUseBlock, "tool_use"), (ToolResultBlock, "tool_result"),
                      (ThinkingBlock, "thinking"))


class Message(StrictModel):
    role: Literal["user", "assistant", "system"]
    content: str | list[ContentBlock]


# ---- tools and options ------------------------------------------------------------------------------


def _object_schema(schema: dict[str, Any]) -> dict[str, Any]:
    if schema.get("type") != "object":
        raise ValueError("the schema's type must be 'object'")
    return schema


# Kept as the client's dict (its key order is what the chat encoders render), checked for type "object".
InputSchema = Annotated[dict[str, Any], AfterValidator(_object_schema), WithJsonSchema(
    {"type": "object", "required": ["type"], "properties": {"type": {"const": "object"}},
     "description": "A JSON schema of the tool's input object"})]


class Tool(StrictModel):
    type: Literal["custom"] | None = None
    name: str = Field(pattern=TOOL_NAME_PATTERN)
    description: str | None = None
    input_schema: InputSchema
    cache_control: dict[str, Any] | None = None
    strict: bool | None = None


AnyTool = tagged_union((Tool, "custom"), default="custom")


class ToolChoiceAuto(StrictModel):
    type: Literal["auto"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceAny(StrictModel):
    type: Literal["any"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceTool(StrictModel):
    type: Literal["tool"]
    name: str = Field(min_length=1)
    disable_parallel_tool_use: bool | None = None


class ToolChoiceNone(StrictModel):
    type: Literal["none"]


ToolChoice = tagged_union((ToolChoiceAuto, "auto"), (ToolChoiceAny, "any"), (ToolChoiceTool, "tool"),
                    (ToolChoiceNone, "none"))


class ThinkingEnabled(StrictModel):
    type: Literal["enabled"]
    budget_tokens: integer(ge=1024)
    display: Literal["summarized", "omitted"] | None = None


class ThinkingDisabled(StrictModel):
    type: Literal["disabled"]


class ThinkingAdaptive(StrictModel):
    type: Literal["adaptive"]
    display: Literal["summarized", "omitted"] | None = None


Thinking = tagged_union((ThinkingEnabled, "enabled"), (ThinkingDisabled, "disabled"), (ThinkingAdaptive, "adaptive"))


class JSONOutputFormat(StrictModel):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(StrictModel):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: JSONOutputFormat | None = None


class Metadata(StrictModel):
    user_id: str | None = Field(default=None, max_length=256)


class CountTokensRequest(RequestBody):
    schema_fields = frozenset({"tools", "tool_choice", "output_config"})

    model: ModelName
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[AnyTool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: MaxTokens
    stop_sequences: list[NonEmptyStr] | None = None
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: integer(ge=0) | None = None
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
    container: refused("not supported by this server (no code-execution containers)") = None
    mcp_servers: refused("not supported by this server (no MCP connector)") = None


# ---- errors -----------------------------------------------------------------------------------------


class AnthropicErrorObject(BaseModel):
    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    type: Literal["error"] = "error"
    error: AnthropicErrorObject


def error_body(status: int, message: str) -> dict[str, Any]:
    kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return AnthropicErrorResponse(error=AnthropicErrorObject(type=kind, message=message)).model_dump()


def from_api_error(e: APIError) -> tuple[int, dict[str, Any], dict[str, str] | None]:
    """(status, body, headers) of a chat-path error in Anthropic's terms: a full queue is 529 overloaded."""
    status = e.status
    if status == 503 and e.headers and "Retry-After" in e.headers:
        status = OVERLOADED
    message = f"{e.param}: {e.message}" if e.param and e.param not in e.message else e.message
    return status, error_body(status, message), e.headers
