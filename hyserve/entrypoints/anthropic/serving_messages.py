"""`POST /v1/messages` and `POST /v1/messages/count_tokens`: a request runs through the chat path
(`messages_input`), and its turn's blocks become thinking, text and tool_use content blocks.

Streaming sends Anthropic's event sequence (what `anthropic`'s `messages.stream` accumulates):
`message_start`, `ping`, then per block `content_block_start`, `content_block_delta` (thinking_delta and a
signature_delta, text_delta, or one input_json_delta with the call's whole input) and
`content_block_stop`, then `message_delta` (stop_reason, usage) and `message_stop`. Every error, raised
anywhere in these routes, has Anthropic's shape (`openai.errors.error_response`).
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from hyserve.entrypoints.anthropic import messages_docs as docs
from hyserve.entrypoints.anthropic.messages_input import CHAT_PARAMS, chat_request
from hyserve.entrypoints.anthropic.protocol import (
    CountTokensRequest,
    MessagesRequest,
    error_body,
    from_api_error,
)
from hyserve.entrypoints.openai.protocol import APIError
from hyserve.entrypoints.openai.serving_chat import ChatRun, render_chat_prompt, start_chat_completion
from hyserve.entrypoints.openai.serving_common import ServerState
from hyserve.entrypoints.openai.turn_blocks import (
    Block,
    BlockEvent,
    TurnEnd,
    TurnStart,
    collected_deltas,
    streamed_deltas,
    turn_events,
)


def signature(thinking: str) -> str:
    """A thinking block's `signature`: a digest of its text (this server does not sign its thinking)."""
    return base64.b64encode(hashlib.sha256(thinking.encode()).digest()).decode()


def _tool_input(arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        value = None
    # Not an object: hand over what the model wrote rather than invent arguments.
    return value if isinstance(value, dict) else {"arguments": arguments}


def content_block(b: Block) -> dict[str, Any]:
    if b.kind == "reasoning":
        return {"type": "thinking", "thinking": b.text, "signature": signature(b.text)}
    if b.kind == "text":
        return {"type": "text", "text": b.text}
    return {"type": "tool_use", "id": b.call_id, "name": b.name, "input": _tool_input(b.text)}


def _stop(end: TurnEnd) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence)."""
    if end.finish_reason == "length":
        return "max_tokens", None
    if isinstance(end.stop_reason, str):
        return "stop_sequence", end.stop_reason
    return ("tool_use" if end.called else "end_turn"), None


def _usage(prompt_tokens: int, cached: int, output_tokens: int) -> dict[str, int]:
    # Anthropic counts cache reads apart from input_tokens (input = input_tokens + cache reads).
    return {"input_tokens": prompt_tokens - cached, "output_tokens": output_tokens,
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def _message(state: ServerState, rid: str, content: list, stop: tuple[str | None, str | None],
             usage: dict[str, int]) -> dict[str, Any]:
    return {"id": rid, "type": "message", "role": "assistant", "model": state.served_model_name,
            "content": content, "stop_reason": stop[0], "stop_sequence": stop[1], "usage": usage}


def _sse(kind: str, **payload: Any) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **payload}, ensure_ascii=False)}\n\n"


def _block_events(ev: BlockEvent) -> list[str]:
    b = ev.block
    if ev.kind == "open":
        start = {"reasoning": {"type": "thinking", "thinking": "", "signature": ""},
                 "text": {"type": "text", "text": ""},
                 "tool_call": {"type": "tool_use", "id": b.call_id, "name": b.name, "input": {}}}[b.kind]
        return [_sse("content_block_start", index=b.index, content_block=start)]
    if ev.kind == "delta":
        if b.kind == "reasoning":
            return [_sse("content_block_delta", index=b.index, delta={"type": "thinking_delta", "thinking": ev.delta})]
        if b.kind == "text":
            return [_sse("content_block_delta", index=b.index, delta={"type": "text_delta", "text": ev.delta})]
        return []  # a call's input goes out whole, at its close, so the client always gets valid JSON
    events = []
    if b.kind == "reasoning":
        events.append(_sse("content_block_delta", index=b.index,
                           delta={"type": "signature_delta", "signature": signature(b.text)}))
    elif b.kind == "tool_call":
        partial = json.dumps(_tool_input(b.text), ensure_ascii=False)
        events.append(_sse("content_block_delta", index=b.index,
                           delta={"type": "input_json_delta", "partial_json": partial}))
    return events + [_sse("content_block_stop", index=b.index)]


async def _stream(state: ServerState, run: ChatRun, max_calls: int | None) -> AsyncIterator[str]:
    try:
        async for ev in turn_events(run, streamed_deltas(run), max_calls):
            if isinstance(ev, TurnStart):
                usage = _usage(ev.prompt_tokens, ev.cached_tokens, 0)
                yield _sse("message_start", message=_message(state, run.rid, [], (None, None), usage))
                yield _sse("ping")
            elif isinstance(ev, BlockEvent):
                for event in _block_events(ev):
                    yield event
            else:
                stop = _stop(ev)
                usage = _usage(ev.prompt_tokens, ev.cached_tokens, ev.output_tokens)
                yield _sse("message_delta", delta={"stop_reason": stop[0], "stop_sequence": stop[1]}, usage=usage)
                yield _sse("message_stop")
    except Exception as e:
        body = from_api_error(e)[1] if isinstance(e, APIError) else error_body(500, str(e))
        yield f"event: error\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"


async def create_message(state: ServerState, req: MessagesRequest, request: Request):
    try:
        run = await start_chat_completion(state, chat_request(req, req.stream), id_prefix="msg")
    except APIError as e:
        raise e.renamed(CHAT_PARAMS) from e
    choice = req.tool_choice
    max_calls = 1 if getattr(choice, "disable_parallel_tool_use", None) else None
    if req.stream:
        return StreamingResponse(_stream(state, run, max_calls), media_type="text/event-stream")
    end: TurnEnd | None = None
    async for ev in turn_events(run, collected_deltas(run, request), max_calls):
        if isinstance(ev, TurnEnd):
            end = ev
    assert end is not None
    usage = _usage(end.prompt_tokens, end.cached_tokens, end.output_tokens)
    return JSONResponse(_message(state, run.rid, [content_block(b) for b in end.blocks], _stop(end), usage))


def messages_router(state: Callable[[], ServerState]) -> APIRouter:
    router = APIRouter(tags=["anthropic"])

    @router.post("/v1/messages", responses=docs.CREATE)
    async def messages_create(req: MessagesRequest, request: Request):
        return await create_message(state(), req, request)

    @router.post("/v1/messages/count_tokens", responses=docs.COUNT_TOKENS)
    async def messages_count_tokens(req: CountTokensRequest) -> dict:
        try:
            return {"input_tokens": len(render_chat_prompt(state(), chat_request(req)).ids)}
        except APIError as e:
            raise e.renamed(CHAT_PARAMS) from e

    return router
