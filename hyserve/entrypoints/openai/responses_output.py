"""A Responses API turn's output: the output items (reasoning, message, function_call) and the Response
object built from a chat run's block events, and the stream events each step makes, in the order the
official `openai` SDK accumulates them (`response.output_item.added`, `response.content_part.added`,
`response.reasoning_text.delta` / `response.output_text.delta` / `response.function_call_arguments.delta`,
the `.done` events, then `response.completed` or `response.incomplete`).
"""

from __future__ import annotations

import time
from typing import Any

from hyserve.entrypoints.openai.protocol_responses import ResponsesRequest
from hyserve.entrypoints.openai.responses_items import encrypt_reasoning
from hyserve.entrypoints.openai.responses_store import ResponseStore, StoredResponse
from hyserve.entrypoints.openai.serving_chat import ChatRun
from hyserve.entrypoints.openai.serving_common import ServerState, new_id
from hyserve.entrypoints.openai.turn_blocks import Block, BlockEvent, TurnEnd


class ResponseTurn:
    """Output items and the Response object of one turn; `apply` also names the stream events it makes.
    With a `store`, the finished response goes into it before its final event is made, so a client that
    continues it at once finds it."""

    def __init__(self, state: ServerState, req: ResponsesRequest, run: ChatRun, new: list[dict],
                 store: ResponseStore | None) -> None:
        self.state, self.req, self.run, self.new, self.store = state, req, run, new, store
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
        if self.store is not None:
            entry = StoredResponse(self.final, self.req.previous_response_id, self.new + [end.assistant_message()])
            self.store.put(self.run.rid, entry)
        return [self.event(f"response.{status}", response=self.final)]
