"""What /openapi.json declares for the Responses API routes: the bodies `responses_output` builds (as the
official `openai` package's `openai.types.responses.Response` reads them) and every status code each route
answers, errors in the OpenAI error shape. Documentation only: the handlers build dicts, which these
describe.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from hyserve.entrypoints.openai import api_docs

Status = Literal["in_progress", "completed", "incomplete", "failed"]


class OutputTextPart(BaseModel):
    type: Literal["output_text"]
    text: str
    annotations: list[dict[str, Any]]
    logprobs: list[dict[str, Any]]


class ReasoningTextPart(BaseModel):
    type: Literal["reasoning_text"]
    text: str


class ReasoningOutput(BaseModel):
    id: str
    type: Literal["reasoning"]
    summary: list[dict[str, Any]]
    content: list[ReasoningTextPart]
    status: Status
    encrypted_content: str | None = Field(None, description="with include: ['reasoning.encrypted_content']")


class MessageOutput(BaseModel):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    status: Status
    content: list[OutputTextPart]


class FunctionCallOutput(BaseModel):
    id: str
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str = Field(description="the call's arguments as the model wrote them (a JSON object)")
    status: Status


class InputTokensDetails(BaseModel):
    cached_tokens: int = Field(description="input tokens read from the prefix cache")
    cache_write_tokens: int


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int


class ResponseUsage(BaseModel):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens_details: OutputTokensDetails


class ReasoningConfig(BaseModel):
    effort: str | None
    summary: str | None


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"]
    created_at: int
    completed_at: int | None = Field(None, description="absent while in progress and when incomplete")
    status: Status
    background: bool
    error: dict[str, Any] | None
    incomplete_details: dict[str, Any] | None = Field(description="{'reason': 'max_output_tokens'} when cut short")
    instructions: str | None
    max_output_tokens: int | None
    max_tool_calls: int | None
    model: str
    output: list[ReasoningOutput | MessageOutput | FunctionCallOutput]
    parallel_tool_calls: bool
    previous_response_id: str | None
    reasoning: ReasoningConfig
    service_tier: str
    store: bool
    temperature: float
    text: dict[str, Any]
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    top_logprobs: int
    top_p: float
    truncation: str
    usage: ResponseUsage | None
    user: str | None
    metadata: dict[str, str]


class InputTokensResponse(BaseModel):
    object: Literal["response.input_tokens"]
    input_tokens: int


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response"]
    deleted: Literal[True]


_NOT_FOUND = {404: "The model is not served here, or `previous_response_id` names a response that is not "
                   "stored (never stored, deleted, or evicted from the bounded store)."}
CREATE = {**api_docs.json_ok(ResponseObject, stream=True, what="A Response object; events of the stream "
                             "(response.created ... response.completed) as `event`/`data` pairs"),
          **api_docs.errors(400, 401, 404, 413, 500, 503, notes=_NOT_FOUND)}
INPUT_TOKENS = {**api_docs.json_ok(InputTokensResponse), **api_docs.errors(400, 401, 404, 413, notes=_NOT_FOUND)}
_STORED = {400: "`stream=true`: streaming a stored response is not supported.",
           404: "No response with this id is stored (never stored, deleted, or evicted)."}
RETRIEVE = {**api_docs.json_ok(ResponseObject), **api_docs.errors(400, 401, 404, notes=_STORED)}
DELETE = {**api_docs.json_ok(DeletedResponse), **api_docs.errors(401, 404, notes=_STORED)}
