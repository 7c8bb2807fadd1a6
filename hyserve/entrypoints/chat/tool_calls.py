"""Tool-call parsers and the per-completion `OutputParser` (docs/ARCHITECTURE.md §8.2).

The tool parser is the second stage: it gets the answer-side ids from the reasoning parser and turns them
into content text and tool calls. `make_output_parser` composes the two stages for one completion:

    parser = make_output_parser("k3", tokenizer, prompt_opens_thinking=True, tools_enabled=True)
    delta = parser.feed(new_ids)      # per engine step, streaming
    delta = parser.finish()           # once, at the end: flushes held-back text
    result = fresh_parser.parse(ids)  # non-streaming, on a parser that was never fed

Streaming and non-streaming run the same code, so the joined deltas always equal `parse`.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from hyserve.entrypoints.chat.reasoning import (
    IdentityReasoningParser,
    K2ReasoningParser,
    K3ReasoningParser,
    ReasoningParser,
    Tag,
    TextStream,
    TokenizerLike,
    XtmlLexer,
    require_token_id,
)


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON string, as in the OpenAI API
    type: str = "function"

    def to_openai(self) -> dict[str, Any]:
        function = {"name": self.name, "arguments": self.arguments}
        return {"id": self.id, "type": self.type, "function": function}


@dataclass
class ToolCallDelta:
    """One streamed piece of a tool call, in the OpenAI `delta.tool_calls[i]` shape."""

    index: int
    id: str | None = None
    type: str | None = None
    name: str | None = None
    arguments: str | None = None

    def to_openai(self) -> dict[str, Any]:
        out: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            out["id"] = self.id
        if self.type is not None:
            out["type"] = self.type
        function = {k: v for k, v in (("name", self.name), ("arguments", self.arguments)) if v is not None}
        if function:
            out["function"] = function
        return out


@dataclass
class Delta:
    reasoning: str | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def is_empty(self) -> bool:
        return self.reasoning is None and self.content is None and not self.tool_calls


@dataclass
class ParsedOutput:
    reasoning: str | None = None
    content: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)


class ToolParser(Protocol):
    """Second stage: `feed` returns (content text released now, tool-call deltas)."""

    @property
    def tool_calls(self) -> list[ToolCall]: ...

    def feed(self, ids: list[int]) -> tuple[str, list[ToolCallDelta]]: ...

    def finish(self) -> tuple[str, list[ToolCallDelta]]: ...


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def decode_k3_argument(value: str, type_name: str | None) -> Any:
    """An `argument` body by its `type` attribute: strings are raw, other types are JSON."""
    if type_name in (None, "string"):
        return value
    try:
        return json.loads(value)
    except ValueError:
        # A model's malformed number or object must not fail the request; keep what it wrote.
        return value


# ---------------------------------------------------------------------------------------------------
# K3


@dataclass
class _K3Call:
    name: str
    args: dict[str, Any] = field(default_factory=dict)
    raw_json: str | None = None  # body of a `json` block: arguments the encoder could not split


class K3ToolParser:
    """K3: content is the `response` channel; each complete `call` block becomes one tool call.

    Text outside any channel is content too, so a reply whose `response` opener is missing (a grammar
    that forced JSON right after `think`) is not lost. Markup that is not ours (`message`, unknown tags)
    is dropped, and so are special ids in text (<|end_of_msg|>), on every path. Calls stream whole, once
    `<|close|>call<|sep|>` arrives, because K3 arguments are typed per key and only a finished block
    can be turned into JSON.
    """

    def __init__(self, tokenizer: TokenizerLike, *, tools_enabled: bool = True) -> None:
        self._tokenizer = tokenizer
        self._lexer = XtmlLexer(tokenizer)
        self._content = TextStream(tokenizer)
        self._tools_enabled = tools_enabled
        self._call: _K3Call | None = None
        self._body: list[int] | None = None  # ids of the open `argument` / `json` block
        self._body_tag: Tag | None = None
        self._in_tools = False
        self._calls: list[ToolCall] = []

    @property
    def tool_calls(self) -> list[ToolCall]:
        return list(self._calls)

    def feed(self, ids: list[int]) -> tuple[str, list[ToolCallDelta]]:
        content: list[str] = []
        deltas: list[ToolCallDelta] = []
        for event in self._lexer.feed(ids):
            if isinstance(event, Tag):
                content.append(self._content.take(final=True))
                delta = self._on_tag(event)
                if delta is not None:
                    deltas.append(delta)
            elif self._body is not None:
                self._body.extend(event)
            elif self._call is None and not self._in_tools:
                self._content.push(event)
            # else: whitespace between tool blocks carries no meaning.
        content.append(self._content.take())
        return "".join(content), deltas

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        # An unfinished call was cut by max_tokens; only complete blocks become calls.
        self._lexer.finish()
        return self._content.take(final=True), []

    def _on_tag(self, tag: Tag) -> ToolCallDelta | None:
        if tag.name in ("argument", "json") and self._call is not None:
            self._end_body()
            if not tag.closing:
                self._body, self._body_tag = [], tag
        elif tag.name == "call":
            self._end_body()
            call, self._call = self._call, None
            if tag.closing:
                return self._emit(call)
            # An opener while a call is open means the earlier one was never closed: it is dropped.
            self._call = _K3Call(name=tag.attrs.get("tool", "").strip())
        elif tag.name == "tools":
            self._in_tools = not tag.closing
        return None

    def _end_body(self) -> None:
        if self._body is None or self._body_tag is None or self._call is None:
            self._body = self._body_tag = None
            return
        text = self._tokenizer.decode(self._body, skip_special_tokens=True)
        attrs = self._body_tag.attrs
        if self._body_tag.name == "json":
            self._call.raw_json = text
        elif "key" in attrs:
            self._call.args[attrs["key"]] = decode_k3_argument(text, attrs.get("type"))
        self._body = self._body_tag = None

    def _emit(self, call: _K3Call | None) -> ToolCallDelta | None:
        if call is None or not call.name or not self._tools_enabled:
            return None
        tool_call = ToolCall(id=new_call_id(), name=call.name, arguments=_k3_arguments_json(call))
        self._calls.append(tool_call)
        return ToolCallDelta(
            index=len(self._calls) - 1,
            id=tool_call.id,
            type=tool_call.type,
            name=tool_call.name,
            arguments=tool_call.arguments,
        )


def _k3_arguments_json(call: _K3Call) -> str:
    args = call.args
    if call.raw_json is not None:
        try:
            parsed = json.loads(call.raw_json)
        except ValueError:
            parsed = None
        if not isinstance(parsed, dict):
            # Not an object: hand the client what the model wrote rather than invent arguments.
            return call.raw_json if not args else json.dumps(args, ensure_ascii=False)
        args = {**parsed, **args}
    return json.dumps(args, ensure_ascii=False)


# ---------------------------------------------------------------------------------------------------
# K2


_K2_CALL_ID = re.compile(r"(?:functions\.)?([\w\-]+):(\d+)")
_K2_COUNTER = re.compile(r"\d+")


def resolve_k2_call_id(call_id: str, tool_names: Sequence[str] | None) -> tuple[str, str] | None:
    """(id, function name) of a K2 call header, or None when it is not a call to a declared tool.

    `functions.NAME:IDX` (the K2 format; `NAME:IDX` too) names its function. A bare counter (`0`), which
    K2 models sometimes write, names none: it resolves only when exactly one tool is declared, and then
    gets the canonical id. Anything else (`weird@id`, `functions.f.0`) and names that no declared tool
    has are not calls. `tool_names` None: the tools are unknown, so any well-formed name is accepted.
    """
    if m := _K2_CALL_ID.fullmatch(call_id):
        name = m.group(1)
        return (call_id, name) if tool_names is None or name in tool_names else None
    if _K2_COUNTER.fullmatch(call_id) and tool_names is not None and len(set(tool_names)) == 1:
        name = tool_names[0]
        return f"functions.{name}:{int(call_id)}", name
    return None


class K2ToolParser:
    """K2: `<|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{json}<|tool_call_end|>`.

    Every marker is one special id, so no text is ever held back for a partial marker. The call id is the
    text `functions.NAME:IDX` itself (`resolve_k2_call_id` says which ids are calls). Streaming sends
    id/type/name once, when the argument marker arrives, then the arguments as suffix diffs; a call cut by
    max_tokens keeps what was sent, so the non-streaming result equals the joined stream. Content is the
    text outside the section; a stray call-end marker in content is dropped and the text goes on.
    """

    def __init__(self, tokenizer: TokenizerLike, *, tools_enabled: bool = True,
                 tool_names: Sequence[str] | None = None) -> None:
        self._tokenizer = tokenizer
        self._tool_names = None if tool_names is None else list(tool_names)
        self._section_begin = require_token_id(tokenizer, "<|tool_calls_section_begin|>")
        self._section_end = require_token_id(tokenizer, "<|tool_calls_section_end|>")
        self._call_begin = require_token_id(tokenizer, "<|tool_call_begin|>")
        self._args_begin = require_token_id(tokenizer, "<|tool_call_argument_begin|>")
        self._call_end = require_token_id(tokenizer, "<|tool_call_end|>")
        self._tools_enabled = tools_enabled
        self._content = TextStream(tokenizer)
        self._args = TextStream(tokenizer)
        self._mode: Literal["content", "section", "call_id", "args"] = "content"
        self._id_ids: list[int] = []
        self._call: ToolCall | None = None  # the call whose arguments are streaming
        self._calls: list[ToolCall] = []

    @property
    def tool_calls(self) -> list[ToolCall]:
        return list(self._calls)

    def feed(self, ids: list[int]) -> tuple[str, list[ToolCallDelta]]:
        content: list[str] = []
        deltas: list[ToolCallDelta] = []
        for token in ids:
            if token == self._section_begin:
                content.append(self._content.take(final=True))
                self._end_call(deltas)
                self._mode = "section"
            elif token == self._section_end:
                self._end_call(deltas)
                self._mode = "content"
            elif token == self._call_begin:
                # A bare begin (no section opener) still starts a call.
                content.append(self._content.take(final=True))
                self._end_call(deltas)
                self._mode, self._id_ids = "call_id", []
            elif token == self._args_begin and self._mode == "call_id":
                self._start_call(deltas)
            elif token == self._call_end and self._mode != "content":
                self._end_call(deltas)
                self._mode = "section"
            elif self._mode == "content":
                self._content.push([token])
            elif self._mode == "call_id":
                self._id_ids.append(token)
            elif self._mode == "args":
                self._args.push([token])
        content.append(self._content.take())
        self._stream_args(deltas, final=False)
        return "".join(content), deltas

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        deltas: list[ToolCallDelta] = []
        self._end_call(deltas)
        return self._content.take(final=True), deltas

    def _start_call(self, deltas: list[ToolCallDelta]) -> None:
        raw_id = self._tokenizer.decode(self._id_ids, skip_special_tokens=True).strip()
        self._mode = "args"
        resolved = resolve_k2_call_id(raw_id, self._tool_names) if self._tools_enabled else None
        if resolved is None:
            return  # not a call to a declared tool: its arguments are read and dropped
        call_id, name = resolved
        self._call = ToolCall(id=call_id, name=name, arguments="")
        self._calls.append(self._call)
        deltas.append(ToolCallDelta(index=len(self._calls) - 1, id=call_id, type="function", name=name))

    def _stream_args(self, deltas: list[ToolCallDelta], *, final: bool) -> None:
        text = self._args.take(final=final)
        if self._call is None or not text:
            return
        self._call.arguments += text
        deltas.append(ToolCallDelta(index=len(self._calls) - 1, arguments=text))

    def _end_call(self, deltas: list[ToolCallDelta]) -> None:
        self._stream_args(deltas, final=True)
        self._call = None


# ---------------------------------------------------------------------------------------------------
# One completion


class OutputParser:
    """Reasoning, content and tool calls of one completion, from its generated ids only."""

    def __init__(self, reasoning: ReasoningParser, tools: ToolParser) -> None:
        self._reasoning = reasoning
        self._tools = tools
        self._fed = False

    @property
    def in_reasoning(self) -> bool:
        """True while the completion is still inside its reasoning channel."""
        return self._reasoning.in_reasoning

    def feed(self, new_token_ids: list[int]) -> Delta:
        self._fed = True
        reasoning, rest = self._reasoning.feed(list(new_token_ids))
        content, calls = self._tools.feed(rest)
        return Delta(reasoning or None, content or None, calls)

    def finish(self) -> Delta:
        self._fed = True
        reasoning, rest = self._reasoning.finish()
        content, calls = self._tools.feed(rest)
        tail, tail_calls = self._tools.finish()
        return Delta(reasoning or None, (content + tail) or None, calls + tail_calls)

    def parse(self, all_token_ids: list[int]) -> ParsedOutput:
        """Non-streaming: the whole completion at once. Use a parser that has not been fed."""
        if self._fed:
            raise RuntimeError("parse() needs a fresh OutputParser; this one was already fed")
        first, last = self.feed(all_token_ids), self.finish()
        reasoning = (first.reasoning or "") + (last.reasoning or "")
        content = (first.content or "") + (last.content or "")
        return ParsedOutput(reasoning or None, content or None, self._tools.tool_calls)


def make_output_parser(
    family: str, tokenizer: TokenizerLike, *, prompt_opens_thinking: bool, tools_enabled: bool,
    tool_names: Sequence[str] | None = None,
) -> OutputParser:
    """The parser for one completion of a `family` ("k3" or "k2") model.

    `prompt_opens_thinking`: the completion starts as reasoning (the encoder's `prompt_opens_thinking`:
    K3's prompt left a think channel open; K2 with thinking on, whose `<think>` is optional). K3 with it
    False makes the reasoning stage an identity; K2 still reads a `<think>` the model writes itself.
    `tools_enabled`: the request offered tools; otherwise tool blocks are dropped, never returned.
    `tool_names`: the declared functions (K2 resolves bare-counter call ids against them and drops calls
    to undeclared ones); None accepts any name.
    """
    reasoning: ReasoningParser
    if family == "k3":
        if prompt_opens_thinking:
            reasoning = K3ReasoningParser(tokenizer)
        else:
            reasoning = IdentityReasoningParser()
        return OutputParser(reasoning, K3ToolParser(tokenizer, tools_enabled=tools_enabled))
    if family == "k2":
        # Kimi-Linear has no think tokens: it never reasons, whatever the prompt says.
        if all(tokenizer.token_to_id(t) is not None for t in ("<think>", "</think>")):
            reasoning = K2ReasoningParser(tokenizer, start_in_reasoning=prompt_opens_thinking)
        else:
            reasoning = IdentityReasoningParser()
        tools = K2ToolParser(tokenizer, tools_enabled=tools_enabled, tool_names=tool_names)
        return OutputParser(reasoning, tools)
    raise ValueError(f"unknown chat family {family!r}; expected 'k3' or 'k2'")
