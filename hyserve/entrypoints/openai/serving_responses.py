"""The OpenAI Responses API: `POST /v1/responses` (streaming or not), `GET`/`DELETE /v1/responses/{id}` and
`POST /v1/responses/input_tokens`.

A request becomes a chat request (`responses_items`), runs through the chat path, and its turn's blocks
become output items: reasoning, message and function_call, streamed with the events the official `openai`
SDK accumulates (`response.created`, `response.in_progress`, `response.output_item.added`,
`response.content_part.added`, `response.reasoning_text.delta`, `response.output_text.delta`,
`response.function_call_arguments.delta`/`.done`, the `.done` events, `response.completed` or
`response.incomplete`).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from hyserve.entrypoints.openai.protocol import APIError, ErrorResponse
from hyserve.entrypoints.openai.protocol_responses import InputTokensRequest, ResponsesRequest
from hyserve.entrypoints.openai.responses_items import (
    CHAT_PARAMS,
    chat_request,
    check_supported,
    encrypt_reasoning,
    input_messages,
)
from hyserve.entrypoints.openai.responses_store import MissingResponse, ResponseStore, StoredResponse
from hyserve.entrypoints.openai.serving_chat import ChatRun, render_chat_prompt, start_chat_completion
from hyserve.entrypoints.openai.serving_common import ServerState, new_id
from hyserve.entrypoints.openai.turn_blocks import (
    Block,
    BlockEvent,
    TurnEnd,
    collected_deltas,
    streamed_deltas,
    turn_events,
)

_ERRORS = {400: "Invalid request", 401: "Invalid or missing API key", 404: "No such model or response",
           500: "Internal error", 503: "The engine is not running, or the server is overloaded"}
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    **{code: {"model": ErrorResponse, "description": text} for code, text in _ERRORS.items()},
    "4XX": {"model": ErrorResponse, "description": "Any other client error, in the same shape"},
}
_CREATED = {200: {"description": "A Response object; with `stream: true`, an SSE stream of response events",
                  "content": {"application/json": {"schema": {"type": "object"}},
                              "text/event-stream": {"schema": {"type": "string"}}}}}


def response_store(state: ServerState) -> ResponseStore:
    if "responses_store" not in state.extra:
        state.extra["responses_store"] = ResponseStore.from_env()
    return state.extra["responses_store"]


def in_responses_words(e: APIError) -> APIError:
    return APIError(e.status, e.message, CHAT_PARAMS.get(e.param, e.param), e.headers)


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


class _ResponseTurn:
    """Output items and the Response object of one turn; `apply` also names the stream events it makes."""

    def __init__(self, state: ServerState, req: ResponsesRequest, run: ChatRun, new: list[dict]) -> None:
        self.state, self.req, self.run, self.new = state, req, run, new
        self.created = int(time.time())
        self.items: dict[int, dict[str, Any]] = {}
        self.seq = 0
        self.final: dict[str, Any] = {}
        self.encrypted = "reasoning.encrypted_content" in (req.include or [])

    # ---- the Response object ------------------------------------------------------------------------
    def body(self, status: str, end: TurnEnd | None = None, error: dict | None = None) -> dict[str, Any]:
        req = self.req
        fmt = req.text.format if req.text is not None and req.text.format is not None else None
        choice = req.tool_choice
        body = {
            "id": self.run.rid, "object": "response", "created_at": self.created, "status": status,
            "background": False, "error": error, "incomplete_details": None, "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens, "max_tool_calls": req.max_tool_calls,
            "model": self.state.served_model_name, "output": [self.items[i] for i in sorted(self.items)],
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": req.reasoning.effort if req.reasoning else None,
                          "summary": req.reasoning.summary if req.reasoning else None},
            "service_tier": "default", "store": req.store is not False,
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "text": {"format": fmt.model_dump(by_alias=True) if fmt is not None else {"type": "text"}},
            "tool_choice": choice.model_dump() if hasattr(choice, "model_dump") else (choice or "auto"),
            "tools": [t.model_dump(by_alias=True) for t in req.tools], "top_logprobs": 0,
            "top_p": 1.0 if req.top_p is None else req.top_p, "truncation": "disabled", "usage": None,
            "user": req.user, "metadata": req.metadata or {},
        }
        if end is not None:
            body["usage"] = {
                "input_tokens": end.prompt_tokens, "output_tokens": end.output_tokens,
                "total_tokens": end.prompt_tokens + end.output_tokens,
                "input_tokens_details": {"cached_tokens": end.cached_tokens, "cache_write_tokens": 0},
                "output_tokens_details": {"reasoning_tokens": end.reasoning_tokens},
            }
            if end.finish_reason == "length":
                body["incomplete_details"] = {"reason": "max_output_tokens"}
            else:
                body["completed_at"] = int(time.time())
        return body

    # ---- events -------------------------------------------------------------------------------------
    def event(self, kind: str, **payload: Any) -> tuple[str, dict[str, Any]]:
        payload = {"type": kind, "sequence_number": self.seq, **payload}
        self.seq += 1
        return kind, payload

    def apply(self, ev: Any) -> list[tuple[str, dict[str, Any]]]:
        if isinstance(ev, BlockEvent):
            handler = {"open": self._open, "delta": self._delta, "close": self._close}[ev.kind]
            return handler(ev)
        if isinstance(ev, TurnEnd):
            return self._end(ev)
        return []

    def _where(self, block: Block) -> dict[str, Any]:
        return {"item_id": self.items[block.index]["id"], "output_index": block.index}

    def _open(self, ev: BlockEvent) -> list[tuple[str, dict]]:
        b = ev.block
        if b.kind == "reasoning":
            item = {"id": new_id("rs"), "type": "reasoning", "summary": [], "content": [], "status": "in_progress"}
            part = {"type": "reasoning_text", "text": ""}
        elif b.kind == "text":
            item = {"id": new_id("msg"), "type": "message", "role": "assistant", "status": "in_progress",
                    "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        else:
            item = {"id": new_id("fc"), "type": "function_call", "call_id": b.call_id, "name": b.name,
                    "arguments": "", "status": "in_progress"}
            part = None
        self.items[b.index] = item
        events = [self.event("response.output_item.added", output_index=b.index, item=dict(item))]
        if part is not None:
            events.append(self.event("response.content_part.added", **self._where(b), content_index=0, part=part))
        return events

    def _delta(self, ev: BlockEvent) -> list[tuple[str, dict]]:
        b, where = ev.block, self._where(ev.block)
        if b.kind == "reasoning":
            return [self.event("response.reasoning_text.delta", **where, content_index=0, delta=ev.delta)]
        if b.kind == "text":
            return [self.event("response.output_text.delta", **where, content_index=0, delta=ev.delta, logprobs=[])]
        return [self.event("response.function_call_arguments.delta", **where, delta=ev.delta)]

    def _close(self, ev: BlockEvent) -> list[tuple[str, dict]]:
        b, where, item = ev.block, self._where(ev.block), self.items[ev.block.index]
        item["status"] = "incomplete" if ev.cut else "completed"
        if b.kind == "tool_call":
            item["arguments"] = b.text
            done = self.event("response.function_call_arguments.done", **where, name=b.name, arguments=b.text)
            return [done, self.event("response.output_item.done", output_index=b.index, item=item)]
        if b.kind == "reasoning":
            part = {"type": "reasoning_text", "text": b.text}
            if self.encrypted:
                item["encrypted_content"] = encrypt_reasoning(b.text)
            done = self.event("response.reasoning_text.done", **where, content_index=0, text=b.text)
        else:
            part = {"type": "output_text", "text": b.text, "annotations": [], "logprobs": []}
            done = self.event("response.output_text.done", **where, content_index=0, text=b.text, logprobs=[])
        item["content"] = [part]
        return [done, self.event("response.content_part.done", **where, content_index=0, part=part),
                self.event("response.output_item.done", output_index=b.index, item=item)]

    def _end(self, end: TurnEnd) -> list[tuple[str, dict]]:
        status = "incomplete" if end.finish_reason == "length" else "completed"
        self.final = self.body(status, end)
        if self.req.store is not False:
            entry = StoredResponse(self.final, self.req.previous_response_id, self.new + [end.assistant_message()])
            response_store(self.state).put(self.run.rid, entry)
        return [self.event(f"response.{status}", response=self.final)]


def _sse(kind: str, payload: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def _stream(turn: _ResponseTurn, max_calls: int | None) -> AsyncIterator[str]:
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
    check_supported(req)
    messages, new = _messages(state, req)
    try:
        run = await start_chat_completion(state, chat_request(req, messages, bool(req.stream)), id_prefix="resp")
    except APIError as e:
        raise in_responses_words(e) from e
    turn = _ResponseTurn(state, req, run, new)
    max_calls = 1 if req.parallel_tool_calls is False else None
    if req.stream:
        return StreamingResponse(_stream(turn, max_calls), media_type="text/event-stream")
    async for ev in turn_events(run, collected_deltas(run, request), max_calls):
        turn.apply(ev)
    return JSONResponse(turn.final)


def count_input_tokens(state: ServerState, req: InputTokensRequest) -> dict[str, Any]:
    if req.conversation is not None:
        raise APIError(400, "conversations are not supported; use previous_response_id", param="conversation")
    messages, _ = _messages(state, req)
    try:
        ids = render_chat_prompt(state, chat_request(req, messages)).ids
    except APIError as e:
        raise in_responses_words(e) from e
    return {"object": "response.input_tokens", "input_tokens": len(ids)}


def _stored(state: ServerState, response_id: str) -> StoredResponse:
    entry = response_store(state).get(response_id)
    if entry is None:
        raise APIError(404, f"Response with id {response_id!r} not found.", param="response_id")
    return entry


def responses_router(state: Callable[[], ServerState]) -> APIRouter:
    router = APIRouter(tags=["responses"])

    @router.post("/v1/responses", responses={**_CREATED, **ERROR_RESPONSES})
    async def responses_create(req: ResponsesRequest, request: Request):
        return await create_response(state(), req, request)

    @router.post("/v1/responses/input_tokens", responses=ERROR_RESPONSES)
    async def responses_input_tokens(req: InputTokensRequest) -> dict:
        return count_input_tokens(state(), req)

    @router.get("/v1/responses/{response_id}", responses=ERROR_RESPONSES)
    async def responses_retrieve(response_id: str, stream: bool = False) -> dict:
        if stream:
            raise APIError(400, "streaming a stored response is not supported", param="stream")
        return _stored(state(), response_id).body

    @router.delete("/v1/responses/{response_id}", responses=ERROR_RESPONSES)
    async def responses_delete(response_id: str) -> dict:
        _stored(state(), response_id)
        response_store(state()).delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    return router
