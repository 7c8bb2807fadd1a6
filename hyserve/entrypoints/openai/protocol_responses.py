"""Request models of the OpenAI Responses API (`POST /v1/responses`), after the official `openai`
package's `openai.types.responses` (ResponseCreateParams and the input item params).

Strict as the vendor's API is: a string is never coerced to a number or a bool. Unknown fields are
ignored, as everywhere in this server. Items, content parts, tools and formats of a kind this server does
not serve validate as `Unsupported` (see `strict_models`) and are refused by name with a 400.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from hyserve.entrypoints.strict_models import Strict, tagged_union

NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"
Status = Literal["in_progress", "completed", "incomplete"]
Effort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]
Includable = Literal[
    "file_search_call.results", "web_search_call.results", "web_search_call.action.sources",
    "message.input_image.image_url", "computer_call_output.output.image_url", "code_interpreter_call.outputs",
    "reasoning.encrypted_content", "message.output_text.logprobs",
]


# ---- content parts ----------------------------------------------------------------------------------


class InputText(Strict):
    type: Literal["input_text"]
    text: str


class OutputText(Strict):
    type: Literal["output_text"]
    text: str
    annotations: list[dict[str, Any]] = []


class Refusal(Strict):
    type: Literal["refusal"]
    refusal: str


ContentPart = tagged_union((InputText, "input_text"), (OutputText, "output_text"), (Refusal, "refusal"))


# ---- input items ------------------------------------------------------------------------------------


class MessageItem(Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]
    id: str | None = None
    status: Status | None = None
    phase: Literal["commentary", "final_answer"] | None = None


class FunctionCallItem(Strict):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str
    id: str | None = None
    status: Status | None = None


class FunctionCallOutputItem(Strict):
    type: Literal["function_call_output"]
    call_id: str | None = None
    name: str | None = None
    output: str | list[ContentPart]
    id: str | None = None
    status: Status | None = None


class SummaryText(Strict):
    type: Literal["summary_text"]
    text: str


class ReasoningText(Strict):
    type: Literal["reasoning_text"]
    text: str


class ReasoningItem(Strict):
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


class FunctionTool(Strict):
    type: Literal["function"]
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


Tool = tagged_union((FunctionTool, "function"))


class ToolChoiceFunction(Strict):
    type: Literal["function"]
    name: str = Field(min_length=1)


ToolChoice = Literal["none", "auto", "required"] | tagged_union((ToolChoiceFunction, "function"))


class TextFormatText(Strict):
    type: Literal["text"]


class TextFormatJSONObject(Strict):
    type: Literal["json_object"]


class TextFormatJSONSchema(Strict):
    type: Literal["json_schema"]
    name: str = Field(pattern=NAME_PATTERN)
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


TextFormat = tagged_union((TextFormatText, "text"), (TextFormatJSONObject, "json_object"),
                    (TextFormatJSONSchema, "json_schema"))


class TextConfig(Strict):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class Reasoning(Strict):
    effort: Effort | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesStreamOptions(Strict):
    include_obfuscation: bool | None = None


class ResponsesRequest(Strict):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[Tool] = []
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    reasoning: Reasoning | None = None
    text: TextConfig | None = None
    store: bool | None = None
    previous_response_id: str | None = Field(default=None, min_length=1)
    stream: bool | None = None
    stream_options: ResponsesStreamOptions | None = None
    include: list[Includable] | None = None
    metadata: dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]] | None = Field(
        default=None, max_length=16)
    truncation: Literal["auto", "disabled"] | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    max_tool_calls: int | None = Field(default=None, ge=1)
    background: bool | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    user: str | None = None  # informational, as in OpenAI's API
    safety_identifier: str | None = None  # informational
    prompt_cache_key: str | None = None  # informational: the prefix cache needs no key


class InputTokensRequest(Strict):
    """`POST /v1/responses/input_tokens`: the prompt a create request with these fields would have."""

    model: str | None = None
    input: str | list[InputItem] | None = None
    instructions: str | None = None
    tools: list[Tool] = []
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    reasoning: Reasoning | None = None
    text: TextConfig | None = None
    previous_response_id: str | None = Field(default=None, min_length=1)
    truncation: Literal["auto", "disabled"] | None = None
    conversation: str | dict[str, Any] | None = None
