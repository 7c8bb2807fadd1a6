"""Request models of the OpenAI Responses API (`POST /v1/responses`), after the official `openai`
package's `openai.types.responses` (ResponseCreateParams and the input item params).

Strict as the vendor's API is, and held to the same edge limits as every request body (`strict_models`):
a string is never coerced to a number or a bool. Unknown fields are ignored, as everywhere in this
server. Items, content parts, tools and formats of a kind this server does not serve validate as
`Unsupported` and are refused by name with a 400; so are the fields it cannot honour (`refused`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field
from pydantic_core import PydanticCustomError

from hyserve.entrypoints.strict_models import (
    MaxTokens,
    ModelName,
    RequestBody,
    StrictModel,
    integer,
    refused,
    tagged_union,
)

NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"
Status = Literal["in_progress", "completed", "incomplete"]
Effort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]
Includable = Literal[
    "file_search_call.results", "web_search_call.results", "web_search_call.action.sources",
    "message.input_image.image_url", "computer_call_output.output.image_url", "code_interpreter_call.outputs",
    "reasoning.encrypted_content",
]
_NO_LOGPROBS = "message.output_text.logprobs"


def _without_logprobs(value: Any) -> Any:
    if isinstance(value, list) and _NO_LOGPROBS in value:
        raise PydanticCustomError("unsupported", "{message}",
                                  {"message": f"{_NO_LOGPROBS} is not supported (no logprobs on /v1/responses)"})
    return value


# The other kinds name outputs of built-in tools this server does not run: there is nothing to include.
Include = Annotated[list[Includable], BeforeValidator(_without_logprobs)]
NoConversations = refused("conversations are not supported; use previous_response_id")
NoAutoTruncation = refused("truncation 'auto' is not supported; the input must fit", "disabled")


# ---- content parts ----------------------------------------------------------------------------------


class InputText(StrictModel):
    type: Literal["input_text"]
    text: str


class OutputText(StrictModel):
    type: Literal["output_text"]
    text: str
    annotations: list[dict[str, Any]] = []


class Refusal(StrictModel):
    type: Literal["refusal"]
    refusal: str


ContentPart = tagged_union((InputText, "input_text"), (OutputText, "output_text"), (Refusal, "refusal"))


# ---- input items ------------------------------------------------------------------------------------


class MessageItem(StrictModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]
    id: str | None = None
    status: Status | None = None
    phase: Literal["commentary", "final_answer"] | None = None


class FunctionCallItem(StrictModel):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str
    id: str | None = None
    status: Status | None = None


class FunctionCallOutputItem(StrictModel):
    type: Literal["function_call_output"]
    call_id: str | None = None
    name: str | None = None
    output: str | list[ContentPart]
    id: str | None = None
    status: Status | None = None


class SummaryText(StrictModel):
    type: Literal["summary_text"]
    text: str


class ReasoningText(StrictModel):
    type: Literal["reasoning_text"]
    text: str


class ReasoningItem(StrictModel):
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[SummaryText] = []
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None
    status: Status | None = None


InputItem = tagged_union((MessageItem, "message"), (FunctionCallItem, "function_call"),
                   (FunctionCallOutputItem, "function_call_output"), (ReasoningItem, "reasoning"),
                   default="message")


# ---- tools, formats, options ------------------------------------------------------------------------


class FunctionTool(StrictModel):
    type: Literal["function"]
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


Tool = tagged_union((FunctionTool, "function"))


class ToolChoiceFunction(StrictModel):
    type: Literal["function"]
    name: str = Field(min_length=1)


ToolChoice = Literal["none", "auto", "required"] | tagged_union((ToolChoiceFunction, "function"))


class TextFormatText(StrictModel):
    type: Literal["text"]


class TextFormatJSONObject(StrictModel):
    type: Literal["json_object"]


class TextFormatJSONSchema(StrictModel):
    type: Literal["json_schema"]
    name: str = Field(pattern=NAME_PATTERN)
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


TextFormat = tagged_union((TextFormatText, "text"), (TextFormatJSONObject, "json_object"),
                    (TextFormatJSONSchema, "json_schema"))


class TextConfig(StrictModel):
    format: TextFormat | None = None
    verbosity: refused("not supported by this server's models") = None


class Reasoning(StrictModel):
    effort: Effort | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesStreamOptions(StrictModel):
    include_obfuscation: bool | None = None


class ResponsesRequest(RequestBody):
    schema_fields = frozenset({"tools", "tool_choice", "text"})

    model: ModelName | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[Tool] = []
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: MaxTokens | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    reasoning: Reasoning | None = None
    text: TextConfig | None = None
    store: bool | None = None
    previous_response_id: str | None = Field(default=None, min_length=1)
    stream: bool | None = None
    stream_options: ResponsesStreamOptions | None = None
    include: Include | None = None
    metadata: dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]] | None = Field(
        default=None, max_length=16)
    truncation: NoAutoTruncation = None
    top_logprobs: refused("logprobs are not supported on /v1/responses", 0) = None
    max_tool_calls: integer(ge=1, description="bounds built-in tool calls, which this server has none of") | None = None
    background: refused("background responses are not supported", False) = None
    conversation: NoConversations = None
    prompt: refused("prompt templates are not supported") = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    user: str | None = None  # informational, as in OpenAI's API
    safety_identifier: str | None = None  # informational
    prompt_cache_key: str | None = None  # informational: the prefix cache needs no key


class InputTokensRequest(RequestBody):
    """`POST /v1/responses/input_tokens`: the prompt a create request with these fields would have."""

    schema_fields = ResponsesRequest.schema_fields

    model: ModelName | None = None
    input: str | list[InputItem] | None = None
    instructions: str | None = None
    tools: list[Tool] = []
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    reasoning: Reasoning | None = None
    text: TextConfig | None = None
    previous_response_id: str | None = Field(default=None, min_length=1)
    truncation: NoAutoTruncation = None
    conversation: NoConversations = None
