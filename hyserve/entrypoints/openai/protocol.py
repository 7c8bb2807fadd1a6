"""Request and response models of the OpenAI-compatible API (docs/ARCHITECTURE.md §8.3).

Unknown request fields are ignored (clients send options meant for other servers). Known fields are
strictly typed, as in OpenAI's API (`strict_models`): `"stream": "yes"`, `"max_tokens": "8"` or `"n": true`
are refused, not coerced. The value ranges the server enforces are part of the schema (and so of
/openapi.json), and `limits.check_body` bounds nesting, size and text validity first. Every failure is an HTTP 400; every
known field takes effect or is rejected with a 400 naming it, except `user`, which is informational only
(as in OpenAI's API).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field
from pydantic_core import PydanticKnownError

from hyserve.entrypoints.strict_models import (
    BOUND_KEY,
    MaxTokens,
    ModelName,
    NonEmptyStr,
    RequestBody,
    StrictModel,
    TokenId,
    integer,
)
from hyserve.sampling_params import MAX_LOGPROBS, SEED_MAX, SEED_MIN, max_n

Logprobs = integer(ge=0, le=MAX_LOGPROBS)


def _at_most_max_n(n: int) -> int:
    if n > max_n():  # read when a request comes, as HYSERVE_MAX_N_SEQUENCES is (hyserve/envs.py)
        raise PydanticKnownError("less_than_equal", {"le": max_n()})
    return n


NumChoices = Annotated[integer(ge=1, json_schema_extra={BOUND_KEY: "n"}), AfterValidator(_at_most_max_n)]


class ChatMessageParam(StrictModel):
    """One message of a conversation. Other fields (tool_calls, tool_call_id, name, reasoning, ...) pass
    through to the chat encoder, which checks the conversation as a whole."""

    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[Any] | None = None


def _as_dicts(messages: list[ChatMessageParam]) -> list[dict[str, Any]]:
    return [m.model_dump(exclude_unset=True) for m in messages]


# Validated as messages, handed on as the dicts the chat encoders read.
Messages = Annotated[list[ChatMessageParam], Field(min_length=1), AfterValidator(_as_dicts)]


class StreamOptions(StrictModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class ResponseFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class StructuredOutputs(StrictModel):
    """vLLM's `structured_outputs` extra field: exactly one constraint."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(default=None, min_length=1)
    grammar: str | None = None


class SamplingRequest(RequestBody):
    """Fields shared by completions and chat completions."""

    model: ModelName | None = None
    n: NumChoices = 1
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: integer(ge=-1, description="0 or -1: off") | None = None
    min_p: float | None = Field(None, ge=0, le=1)
    seed: integer(ge=SEED_MIN, le=SEED_MAX) | None = None
    stop: NonEmptyStr | list[NonEmptyStr] | None = None
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool = False
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, gt=0)
    logit_bias: dict[Annotated[str, Field(pattern=r"^[0-9]+$")], float] | None = None
    max_tokens: MaxTokens | None = None
    min_tokens: integer(ge=0) = 0
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    cache_salt: str | None = None
    priority: integer(description="only 0 unless the server runs --scheduling-policy priority") = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool | None = None  # true only with skip_special_tokens (hyserve's decoding)
    prompt_logprobs: Logprobs | None = None
    return_token_ids: bool = False
    # keep the last N prompt tokens; -1: max_model_len
    truncate_prompt_tokens: integer(ge=1) | Literal[-1] | None = None
    best_of: integer(ge=1, description="only n: completions are not ranked") | None = None
    user: str | None = None  # informational only


class CompletionRequest(SamplingRequest):
    prompt: NonEmptyStr | Annotated[list[NonEmptyStr], Field(min_length=1)] \
        | Annotated[list[TokenId], Field(min_length=1)] \
        | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)]
    logprobs: Logprobs | None = None
    echo: bool = False
    suffix: str | None = Field(None, max_length=0, description="not supported: leave it out or empty")


class ChatCompletionRequest(SamplingRequest):
    messages: Messages
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    logprobs: bool = False
    top_logprobs: Logprobs | None = None
    max_completion_tokens: MaxTokens | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False


class TokenizeCompletionRequest(RequestBody):
    model: ModelName | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(RequestBody):
    model: ModelName | None = None
    messages: Messages
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = True
    return_token_strs: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


# vLLM's shape: a prompt or a conversation.
TokenizeRequest = TokenizeCompletionRequest | TokenizeChatRequest


class DetokenizeRequest(RequestBody):
    model: ModelName | None = None
    tokens: list[TokenId]


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
    413: "RequestTooLargeError", 500: "InternalServerError", 501: "NotImplementedError",
    503: "ServiceUnavailableError",
}


class APIError(Exception):
    """Raised anywhere in request handling; the app turns it into the OpenAI error body."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers

    def renamed(self, params: Mapping[str, str]) -> APIError:
        """This error with its param in another API's words (a Responses or Messages request runs as a chat
        request: chat's `max_tokens` is their `max_output_tokens`)."""
        return APIError(self.status, self.message, params.get(self.param, self.param), self.headers)

    def body(self) -> dict[str, Any]:
        info = ErrorInfo(message=self.message, type=ERROR_TYPES.get(self.status, "APIError"),
                         param=self.param, code=self.status)
        return ErrorResponse(error=info).model_dump()
