"""One assistant turn as a sequence of output blocks (reasoning, text, tool call), built from a chat run's
parsed deltas. The Responses API and the Anthropic Messages API both describe a turn this way: a block
opens, takes deltas, closes, and only one block is open at a time.

The turn runs through the chat path (`start_chat_completion`), so it is rendered, constrained and parsed
exactly as a chat completion; streaming and non-streaming answers come from the same events.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal

from fastapi import Request

from hyserve.entrypoints.chat.tool_calls import Delta, ToolCallDelta
from hyserve.entrypoints.openai.serving_chat import ChatRun
from hyserve.entrypoints.openai.serving_common import collect, merge


@dataclass
class Block:
    index: int
    kind: Literal["reasoning", "text", "tool_call"]
    text: str = ""  # the reasoning, the text, or a tool call's arguments (a JSON string)
    call_id: str | None = None
    name: str | None = None


@dataclass
class BlockEvent:
    kind: Literal["open", "delta", "close"]
    block: Block
    delta: str = ""
    cut: bool = False  # a close at the end of a turn that max_tokens cut short


@dataclass
class TurnStart:
    """The prompt is in: sent before the first block, with the prefix-cache hit."""

    prompt_tokens: int
    cached_tokens: int


@dataclass
class TurnEnd:
    finish_reason: str  # "stop" | "length" | "abort"
    stop_reason: Any  # the matched stop string, a stop token id, or None
    blocks: list[Block]
    prompt_tokens: int
    output_tokens: int
    reasoning_tokens: int
    cached_tokens: int

    @property
    def called(self) -> bool:
        return any(b.kind == "tool_call" for b in self.blocks)

    def texts(self, kind: str) -> str:
        return "".join(b.text for b in self.blocks if b.kind == kind)

    def assistant_message(self) -> dict[str, Any]:
        """The turn as a chat assistant message, as a chat client would send it back."""
        calls = [{"id": b.call_id, "type": "function", "function": {"name": b.name, "arguments": b.text}}
                 for b in self.blocks if b.kind == "tool_call"]
        message: dict[str, Any] = {"role": "assistant", "content": self.texts("text")}
        if any(b.kind == "reasoning" for b in self.blocks):
            message["reasoning"] = self.texts("reasoning")
        if calls:
            message["tool_calls"] = calls
        return message


@dataclass
class TurnAssembler:
    """Parser deltas in, block events out. `max_calls` keeps only the first calls (no parallel calls)."""

    max_calls: int | None = None
    blocks: list[Block] = field(default_factory=list)
    _open: Block | None = None
    _calls: dict[int, Block] = field(default_factory=dict)

    def push(self, delta: Delta) -> list[BlockEvent]:
        events: list[BlockEvent] = []
        if delta.reasoning:
            events += self._text("reasoning", delta.reasoning)
        if delta.content:
            events += self._text("text", delta.content)
        for call in delta.tool_calls:
            events += self._call(call)
        return events

    def close(self) -> list[BlockEvent]:
        block, self._open = self._open, None
        return [] if block is None else [BlockEvent("close", block)]

    def _start(self, kind: str, **fields: Any) -> list[BlockEvent]:
        events = self.close()
        self._open = Block(len(self.blocks), kind, **fields)
        self.blocks.append(self._open)
        return events + [BlockEvent("open", self._open)]

    def _text(self, kind: str, text: str) -> list[BlockEvent]:
        events = [] if self._open is not None and self._open.kind == kind else self._start(kind)
        self._open.text += text
        return events + [BlockEvent("delta", self._open, text)]

    def _call(self, call: ToolCallDelta) -> list[BlockEvent]:
        events: list[BlockEvent] = []
        block = self._calls.get(call.index)
        if block is None:
            if self.max_calls is not None and len(self._calls) >= self.max_calls:
                return []
            events = self._start("tool_call", call_id=call.id, name=call.name)
            block = self._calls[call.index] = self._open
        if call.arguments:
            block.text += call.arguments
            events.append(BlockEvent("delta", block, call.arguments))
        return events


async def turn_events(run: ChatRun, deltas: AsyncIterator[Any],
                      max_calls: int | None = None) -> AsyncIterator[TurnStart | BlockEvent | TurnEnd]:
    """The events of the run's (only) completion: TurnStart, block events, then TurnEnd."""
    comp = run.comps[0]
    asm = TurnAssembler(max_calls=max_calls)
    started, cached, reasoning_tokens = False, 0, 0
    async for d in deltas:
        cached = d.num_cached_tokens
        if not started:
            started = True
            yield TurnStart(len(run.ids), cached)
        for c in d.completions:
            if comp.parser.in_reasoning:
                reasoning_tokens += len(c.token_ids)
            for event in asm.push(comp.advance(c)):
                yield event
    for event in asm.close():
        event.cut = comp.finish == "length"
        yield event
    yield TurnEnd(comp.finish or "abort", comp.stop, asm.blocks, len(run.ids), len(comp.ids),
                  reasoning_tokens, cached)


async def streamed_deltas(run: ChatRun) -> AsyncIterator[Any]:
    """The run's deltas as they arrive (a cancelled stream, as on a client disconnect, aborts it)."""
    async for _, d in merge([run.stream]):
        yield d


async def collected_deltas(run: ChatRun, request: Request) -> AsyncIterator[Any]:
    """All of the run's deltas, once it finished; aborted if the client disconnects first."""
    (deltas,) = await collect([run.stream], request)
    for d in deltas:
        yield d
