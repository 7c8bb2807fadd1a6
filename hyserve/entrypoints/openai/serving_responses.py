"""The OpenAI Responses API: `POST /v1/responses` (streaming or not), `GET`/`DELETE /v1/responses/{id}` and
`POST /v1/responses/input_tokens`.

A request becomes a chat request (`responses_items`) and runs through the chat path; its turn becomes
output items and stream events (`responses_output`), the stream opening with `response.created` and
`response.in_progress`. Stored responses live in a bounded store (`responses_store`).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import AfterValidator
from pydantic_core import PydanticCustomError
from starlette.convertors import StringConvertor, register_url_convertor

from hyserve.entrypoints.openai import responses_docs as docs
from hyserve.entrypoints.openai.protocol import APIError
from hyserve.entrypoints.openai.protocol_responses import InputTokensRequest, ResponsesRequest
from hyserve.entrypoints.openai.responses_items import (
    CHAT_PARAMS,
    chat_request,
    input_messages,
)
from hyserve.entrypoints.openai.responses_output import ResponseTurn
from hyserve.entrypoints.openai.responses_store import MissingResponse, ResponseStore, StoredResponse
from hyserve.entrypoints.openai.serving_chat import render_chat_prompt, start_chat_completion
from hyserve.entrypoints.openai.serving_common import ServerState
from hyserve.entrypoints.openai.turn_blocks import (
    collected_deltas,
    streamed_deltas,
    turn_events,
)


def _no_stream(stream: bool) -> bool:
    if stream:
        raise PydanticCustomError("unsupported", "streaming a stored response is not supported")
    return stream


class _ResponseId(StringConvertor):
    """A path segment naming a stored response: any but `input_tokens`, whose path is its own route (so
    that GET /v1/responses/input_tokens is a 405, as the document says, not a lookup of that id)."""

    regex = "(?!input_tokens$)[^/]+"


register_url_convertor("response_id", _ResponseId())
_BY_ID = "/v1/responses/{response_id:response_id}"

# Accepted as OpenAI's API has it, so that the SDK's retrieve works; only false is served.
NoStream = Annotated[bool, AfterValidator(_no_stream),
                     Query(description="only false is served", json_schema_extra={"enum": [False]})]


def response_store(state: ServerState) -> ResponseStore:
    """The server's store (`ResponseStore.for_server`, made when the server starts)."""
    return state.extra["responses_store"]


def _history(store: ResponseStore, previous_id: str | None) -> list[dict]:
    if previous_id is None:
        return []
    try:
        return store.conversation(previous_id)
    except MissingResponse as e:
        gone = "" if e.response_id == previous_id else f" (an earlier turn of {previous_id!r})"
        raise APIError(404, f"Previous response with id {e.response_id!r}{gone} not found: it was never stored "
                       f"(store: false), was deleted, or was evicted (this server keeps the {store.max_entries} "
                       "most recently used responses); send the whole conversation as input instead",
                       param="previous_response_id") from None


def _messages(state: ServerState, req: ResponsesRequest | InputTokensRequest) -> tuple[list[dict], list[dict]]:
    """(the whole conversation to render, the messages this request adds to it)."""
    history = _history(response_store(state), req.previous_response_id)
    new = input_messages(req.input if req.input is not None else [])
    system = [{"role": "system", "content": req.instructions}] if req.instructions is not None else []
    return system + history + new, new


def _sse(kind: str, payload: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def _stream(turn: ResponseTurn, max_calls: int | None) -> AsyncIterator[str]:
    for kind in ("response.created", "response.in_progress"):
        yield _sse(*turn.event(kind, response=turn.body("in_progress")))
    try:
        async for ev in turn_events(turn.run, streamed_deltas(turn.run), max_calls):
            for kind, payload in turn.apply(ev):
                yield _sse(kind, payload)
    except Exception as e:
        message = e.message if isinstance(e, APIError) else str(e)
        yield _sse(*turn.event("error", code="server_error", message=message, param=None))
        failed = turn.body("failed", error={"code": "server_error", "message": message})
        yield _sse(*turn.event("response.failed", response=failed))


async def create_response(state: ServerState, req: ResponsesRequest, request: Request):
    messages, new = _messages(state, req)
    try:
        run = await start_chat_completion(state, chat_request(req, messages, bool(req.stream)), id_prefix="resp")
    except APIError as e:
        raise e.renamed(CHAT_PARAMS) from e
    turn = ResponseTurn(state, req, run, new, response_store(state) if req.store is not False else None)
    max_calls = 1 if req.parallel_tool_calls is False else None
    if req.stream:
        return StreamingResponse(_stream(turn, max_calls), media_type="text/event-stream")
    async for ev in turn_events(run, collected_deltas(run, request), max_calls):
        turn.apply(ev)
    return JSONResponse(turn.final)


def count_input_tokens(state: ServerState, req: InputTokensRequest) -> dict[str, Any]:
    messages, _ = _messages(state, req)
    try:
        ids = render_chat_prompt(state, chat_request(req, messages)).ids
    except APIError as e:
        raise e.renamed(CHAT_PARAMS) from e
    return {"object": "response.input_tokens", "input_tokens": len(ids)}


def _stored(state: ServerState, response_id: str) -> StoredResponse:
    entry = response_store(state).get(response_id)
    if entry is None:
        raise APIError(404, f"Response with id {response_id!r} not found.", param="response_id")
    return entry


def responses_router(state: Callable[[], ServerState]) -> APIRouter:
    router = APIRouter(tags=["responses"])

    @router.post("/v1/responses", responses=docs.CREATE)
    async def responses_create(req: ResponsesRequest, request: Request):
        return await create_response(state(), req, request)

    @router.post("/v1/responses/input_tokens", responses=docs.INPUT_TOKENS)
    async def responses_input_tokens(req: InputTokensRequest) -> dict:
        return count_input_tokens(state(), req)

    @router.get(_BY_ID, responses=docs.RETRIEVE)
    async def responses_retrieve(response_id: str, stream: NoStream = False) -> dict:
        return _stored(state(), response_id).body

    @router.delete(_BY_ID, responses=docs.DELETE)
    async def responses_delete(response_id: str) -> dict:
        _stored(state(), response_id)
        response_store(state()).delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    return router
