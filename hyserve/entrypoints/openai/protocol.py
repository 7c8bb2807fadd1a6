"""Request and response models of the OpenAI-compatible API (docs/ARCHITECTURE.md §8.3).

Unknown request fields are ignored (clients send options meant for other servers); known fields are
type-checked by pydantic, and range checks live in `SamplingParams`, so both surface as HTTP 400.
Every known field takes effect or is rejected with a 400/501 naming it, except `user`, which is
informational only (as in OpenAI's API).
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(OpenAIModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class ResponseFormat(OpenAIModel):
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: dict[str, Any] | None = None


class StructuredOutputs(OpenAIModel):
    """vLLM's `structured_outputs` extra field: exactly one constraint."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(default=None, min_length=1)
    grammar: str | None = None


class SamplingRequest(OpenAIModel):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[str, float] | None = None
    max_tokens: int | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    cache_salt: str | None = None
    priority: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool | None = None  # only False (hyserve's decoding) is accepted
    prompt_logprobs: int | None = None
    return_token_ids: bool = False
    truncate_prompt_tokens: int | None = None  # keep the last N prompt tokens; -1: max_model_len
    best_of: int | None = None  # only None or n: no server-side ranking
    user: str | None = None  # informational only


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None


class ChatCompletionRequest(SamplingRequest):
    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    logprobs: bool = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False


class TokenizeRequest(OpenAIModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = True
    return_token_strs: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: list[int]


# ---- responses --------------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class ModelCard(BaseModel):
    id: str
    object: str = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "hyserve"
    root: str
    max_model_len: int


class ModelList(BaseModel):
    object: str = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorInfo


ERROR_TYPES = {
    400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 405: "MethodNotAllowedError",
    500: "InternalServerError",
    501: "NotImplementedError", 503: "ServiceUnavailableError",
}


class APIError(Exception):
    """Raised anywhere in request handling; the app turns it into the OpenAI error body."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers

    def body(self) -> dict[str, Any]:
        info = ErrorInfo(message=self.message, type=ERROR_TYPES.get(self.status, "APIError"),
                         param=self.param, code=self.status)
        return ErrorResponse(error=info).model_dump()
