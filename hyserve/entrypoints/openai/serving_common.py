"""What completions and chat share: sampling parameters, admission, structured-output specs, collection
of a request's deltas (watching for a client that goes away) and SSE framing."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from pydantic_core import PydanticCustomError

from hyserve.entrypoints.engine_client import AsyncEngineClient, EngineDeadError, EngineRequestError, RequestStream
from hyserve.entrypoints.openai.limits import check_field
from hyserve.entrypoints.openai.protocol import APIError, SamplingRequest
from hyserve.sampling_params import SamplingParams
from hyserve.structured.constraint import StructuredSpec


@dataclass
class ServerState:
    client: AsyncEngineClient
    tokenizer: Any
    served_model_name: str
    model_path: str
    family: str
    chat_encoding: str
    max_waiting_requests: int | None = None
    emit_reasoning_content: bool = False
    metrics: Any = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def max_model_len(self) -> int:
        return int(self.client.info["max_model_len"])

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in (self.served_model_name, self.model_path):
            raise APIError(404, f"The model `{model}` does not exist.", param="model")


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def check_admission(state: ServerState) -> None:
    """503 when the engine is dead, or when its waiting queue is over `--max-waiting-requests`."""
    if not state.client.is_alive:
        raise APIError(503, "The engine is not running.")
    cap = state.max_waiting_requests
    if cap is not None and state.client.num_waiting_estimate >= cap:
        raise APIError(503, f"The server is overloaded: {cap} or more requests are waiting. Retry later.",
                       headers={"Retry-After": "1"})


def resolve_max_tokens(state: ServerState, prompt_len: int, requested: int | None, default: int | None) -> int:
    limit = state.max_model_len
    if prompt_len >= limit:
        raise APIError(400, f"This model's maximum context length is {limit} tokens. However, your request has "
                       f"{prompt_len} input tokens, which leaves no room to generate.", param="messages")
    if requested is None:
        return limit - prompt_len if default is None else min(default, limit - prompt_len)
    if requested < 1:
        raise APIError(400, f"max_tokens must be at least 1, got {requested}", param="max_tokens")
    if prompt_len + requested > limit:
        raise APIError(400, f"This model's maximum context length is {limit} tokens. However, you requested "
                       f"{prompt_len + requested} tokens ({prompt_len} in the input, {requested} for the "
                       f"completion). Please reduce the length of the input or the completion.", param="max_tokens")
    return requested


def check_request(state: ServerState, req: SamplingRequest) -> None:
    """Reject fields that are accepted by the schema but cannot take effect on this server."""
    if req.best_of is not None and req.best_of != req.n:
        raise APIError(400, f"best_of={req.best_of} is not supported (completions are not ranked); "
                       "leave it out or set it to n", param="best_of")
    if req.priority != 0 and state.client.cfg.scheduling_policy != "priority":
        raise APIError(400, "priority needs a server started with --scheduling-policy priority", param="priority")
    if req.truncate_prompt_tokens is not None and req.truncate_prompt_tokens < 1 \
            and req.truncate_prompt_tokens != -1:
        raise APIError(400, f"truncate_prompt_tokens must be -1 or at least 1, got {req.truncate_prompt_tokens}",
                       param="truncate_prompt_tokens")


def truncate_prompt(state: ServerState, req: SamplingRequest, ids: list[int]) -> list[int]:
    """The last `truncate_prompt_tokens` ids (-1: the last max_model_len), as vLLM truncates."""
    n = req.truncate_prompt_tokens
    if n is None:
        return ids
    n = state.max_model_len if n == -1 else n
    return ids[-n:]


def prompt_logprobs_json(entries: list | None) -> list | None:
    """vLLM's shape: one entry per prompt token (the first None), `{token_id: {logprob, rank, decoded_token}}`."""
    if entries is None:
        return None
    return [None if e is None else {str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
                                   for t, lp in e.items()} for e in entries]


def usage_flags(req: SamplingRequest) -> tuple[bool, bool]:
    """(include_usage, continuous_usage_stats): a final usage chunk; usage on every chunk."""
    so = req.stream_options
    return bool(so and so.include_usage), bool(so and so.continuous_usage_stats)


def build_params(req: SamplingRequest, *, max_tokens: int, logprobs: int | None, stop_token_ids: list[int],
                 structured: StructuredSpec | None, skip_special_tokens: bool,
                 prompt_logprobs: int | None = None) -> SamplingParams:
    try:
        return SamplingParams(
            n=req.n, temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p, top_k=0 if req.top_k is None else req.top_k,
            min_p=0.0 if req.min_p is None else req.min_p, seed=req.seed, stop=req.stop,
            stop_token_ids=list(req.stop_token_ids or []) + stop_token_ids,
            include_stop_str_in_output=req.include_stop_str_in_output,
            presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
            repetition_penalty=req.repetition_penalty, logit_bias=req.logit_bias, max_tokens=max_tokens,
            min_tokens=req.min_tokens, ignore_eos=req.ignore_eos, logprobs=logprobs,
            skip_special_tokens=skip_special_tokens, spaces_between_special_tokens=not skip_special_tokens,
            structured=structured, prompt_logprobs=prompt_logprobs,
        )
    except ValueError as e:
        raise APIError(400, str(e)) from e


def structured_constraint(req: SamplingRequest) -> tuple[str, Any] | None:
    """(kind, value) of the request's output constraint, from `structured_outputs` or `response_format`."""
    so = req.structured_outputs
    if so is not None:
        given = [(k, v) for k, v in (("json", so.json_), ("regex", so.regex), ("choice", so.choice),
                                     ("grammar", so.grammar)) if v is not None]
        if len(given) != 1:
            raise APIError(400, "structured_outputs needs exactly one of json, regex, choice or grammar",
                           param="structured_outputs")
        kind, value = given[0]
        if kind == "json" and isinstance(value, str):
            value = _schema_from_text(value)
        return kind, value
    rf = req.response_format
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        return "json", None
    if rf.type == "json_schema":
        schema = (rf.json_schema or {}).get("schema")
        if not isinstance(schema, dict):
            raise APIError(400, "response_format.json_schema.schema must be a JSON schema object",
                           param="response_format")
        return "json", schema
    raise APIError(400, f"response_format type {rf.type!r} is not supported", param="response_format")


def _schema_from_text(text: str) -> Any:
    """structured_outputs.json given as a string: parsed, then held to the limits the body's JSON is."""
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as e:
        raise APIError(400, f"structured_outputs.json is not valid JSON: {e}", param="structured_outputs") from e
    try:
        check_field("structured_outputs", value)
    except PydanticCustomError as e:
        raise APIError(400, e.message(), param="structured_outputs") from e
    return value


def api_error(e: Exception) -> APIError:
    """The HTTP error an engine-side failure means: the client's fault (400), the engine died (503, the
    server restarts under its supervisor), or an engine failure on this request (500)."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, EngineRequestError):
        return APIError(400 if e.bad_request else 500, str(e))
    if isinstance(e, EngineDeadError):
        return APIError(503, f"The engine is not running: {e}")
    return APIError(500, f"{type(e).__name__}: {e}")


async def submit(state: ServerState, request_id: str, ids: list[int], params: SamplingParams,
                 req: SamplingRequest) -> RequestStream:
    check_admission(state)
    try:
        return await state.client.submit(request_id, ids, params, priority=req.priority, cache_salt=req.cache_salt)
    except (EngineRequestError, EngineDeadError) as e:
        raise api_error(e) from e


async def collect(streams: list[RequestStream], request: Request) -> list[list]:
    """All deltas of each stream; aborts everything if the client disconnects first."""

    async def pump(stream: RequestStream) -> list:
        return [d async for d in stream]

    tasks = [asyncio.ensure_future(pump(s)) for s in streams]
    try:
        while True:
            done, pending = await asyncio.wait(tasks, timeout=0.5)
            if not pending:
                return [t.result() for t in tasks]
            if await request.is_disconnected():
                raise APIError(499, "the client disconnected")
    except (EngineRequestError, EngineDeadError) as e:
        raise api_error(e) from e
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            s.abort()


async def merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, Any]]:
    """Deltas of several streams as they arrive, tagged with the stream's position."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for d in stream:
                await queue.put((i, d))
        except Exception as e:  # surfaced to the consumer, in order
            await queue.put((i, e))
        await queue.put((i, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    live = len(tasks)
    try:
        while live:
            i, item = await queue.get()
            if item is None:
                live -= 1
                continue
            if isinstance(item, Exception):
                raise item
            yield i, item
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            s.abort()


def usage(prompt_tokens: int, completion_tokens: int, cached: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens, "prompt_tokens_details": {"cached_tokens": cached}}


def error_event(e: Exception) -> str:
    err = api_error(e)
    return sse(APIError(err.status, err.message).body())
