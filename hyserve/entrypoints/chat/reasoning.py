"""Reasoning parsers: split one completion's generated ids into reasoning text and the rest.

A reasoning parser is the first stage of output parsing (docs/ARCHITECTURE.md §8.2). It works on token ids, never on
rendered text, so that a marker is only ever a special id: text that merely *looks* like a marker (typed
by a user, or written by the model inside a string) is plain BPE and stays text.

Each parser is fed the newly generated ids of one completion and returns the reasoning text it can
release now plus the ids that belong to the answer side, which the tool parser (tool_calls.py) consumes.
Every step does work proportional to the new ids plus a small carry (a partially seen K3 tag, or up to
three bytes of an unfinished UTF-8 character); nothing rescans the context.

This module also holds the two pieces both stages share: incremental detokenization (`TextStream`) and
the K3 XTML tag lexer (`XtmlLexer`).
"""

from __future__ import annotations

import codecs
import re
from dataclasses import dataclass, field
from typing import Protocol

# Ids between <|open|>/<|close|> and <|sep|>. Real tag headers are a few dozen tokens; a header that grows
# past this was a stray special id, and its ids are released as text rather than stalling the stream.
_MAX_HEADER_IDS = 256


class TokenizerLike(Protocol):
    """The part of `hyserve.tokenizer.Tokenizer` the parsers use."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...

    def ids_to_bytes(self, ids: list[int], skip_special_tokens: bool = True) -> bytes: ...

    def token_to_id(self, token: str) -> int | None: ...


def require_token_id(tokenizer: TokenizerLike, token: str) -> int:
    token_id = tokenizer.token_to_id(token)
    if token_id is None:
        raise ValueError(f"tokenizer has no special token {token!r}")
    return token_id


class TextStream:
    """Decodes a run of text ids incrementally, never releasing half of a UTF-8 character.

    A BPE token can end inside a character; its bytes wait in the decoder (at most three) until the
    rest arrives. Joined, the pieces equal a one-shot `decode` of the run.
    """

    def __init__(self, tokenizer: TokenizerLike) -> None:
        self._tokenizer = tokenizer
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._pieces: list[str] = []

    def push(self, ids: list[int]) -> None:
        # Special ids never reach the user: <|end_of_msg|>, [EOS] and friends vanish here.
        data = self._tokenizer.ids_to_bytes(ids, skip_special_tokens=True)
        self._pieces.append(self._decoder.decode(data, final=False))

    def take(self, final: bool = False) -> str:
        """Text pushed since the last take; `final` ends the run, flushing an unfinished character."""
        if final:
            self._pieces.append(self._decoder.decode(b"", final=True))
            self._decoder.reset()
        text = "".join(self._pieces)
        self._pieces = []
        return text


# ---------------------------------------------------------------------------------------------------
# K3 XTML tags on token ids


@dataclass
class Tag:
    """One complete K3 tag: `<|open|>name k="v"<|sep|>` or `<|close|>name<|sep|>`."""

    closing: bool
    name: str
    attrs: dict[str, str]
    ids: list[int] = field(repr=False)


# Lexer events: a run of text ids, or a tag.
Event = list[int] | Tag

_ATTR = re.compile(r'([A-Za-z_][\w.\-]*)="([^"]*)"')


def unescape_attr(value: str) -> str:
    # The encoder escapes & first and " second, so undo in the reverse order.
    return value.replace("&quot;", '"').replace("&amp;", "&")


def parse_tag_header(text: str) -> tuple[str, dict[str, str]]:
    """`call tool="f" index="1"` -> ("call", {"tool": "f", "index": "1"})."""
    parts = text.strip().split(None, 1)
    if not parts:
        return "", {}
    attrs = {key: unescape_attr(value) for key, value in _ATTR.findall(parts[1] if len(parts) > 1 else "")}
    return parts[0], attrs


class XtmlLexer:
    """Cuts a K3 id stream into text runs and tags.

    A tag starts only at the special id <|open|> or <|close|> and ends at the special id <|sep|>, so a
    BPE-spelled lookalike is text. A tag still missing its <|sep|> is held back (the carry); at the end of
    the completion it is a marker cut by max_tokens and is dropped.
    """

    def __init__(self, tokenizer: TokenizerLike) -> None:
        self._tokenizer = tokenizer
        self._open = require_token_id(tokenizer, "<|open|>")
        self._close = require_token_id(tokenizer, "<|close|>")
        self._sep = require_token_id(tokenizer, "<|sep|>")
        self._pending: list[int] = []  # an unfinished tag: its opening special id, then header ids

    def feed(self, ids: list[int]) -> list[Event]:
        events: list[Event] = []
        text: list[int] = []
        for token in ids:
            if token == self._open or token == self._close:
                # A new tag start abandons an unfinished one: that was a stray special id.
                if text:
                    events.append(text)
                    text = []
                self._pending = [token]
            elif not self._pending:
                text.append(token)
            elif token == self._sep:
                events.append(self._make_tag(self._pending + [token]))
                self._pending = []
            else:
                self._pending.append(token)
                if len(self._pending) > _MAX_HEADER_IDS:
                    text.extend(self._pending[1:])
                    self._pending = []
        if text:
            events.append(text)
        return events

    def finish(self) -> list[Event]:
        self._pending = []
        return []

    def _make_tag(self, ids: list[int]) -> Tag:
        header = self._tokenizer.decode(ids[1:-1], skip_special_tokens=True)
        name, attrs = parse_tag_header(header)
        return Tag(closing=ids[0] == self._close, name=name, attrs=attrs, ids=ids)


# ---------------------------------------------------------------------------------------------------
# Reasoning parsers


class ReasoningParser(Protocol):
    """First stage: `feed` returns (reasoning text released now, ids for the answer side)."""

    @property
    def in_reasoning(self) -> bool: ...

    def feed(self, ids: list[int]) -> tuple[str, list[int]]: ...

    def finish(self) -> tuple[str, list[int]]: ...


class IdentityReasoningParser:
    """Thinking off: everything belongs to the answer side."""

    in_reasoning = False

    def feed(self, ids: list[int]) -> tuple[str, list[int]]:
        return "", list(ids)

    def finish(self) -> tuple[str, list[int]]:
        return "", []


class K3ReasoningParser:
    """K3: reasoning is the body of the `think` channel.

    The generation prompt normally opens `think` itself, so the parser starts inside it. Reasoning has
    ended iff the newest think marker in the generated ids is the close marker; history think channels
    live in the prompt, which the parser never sees. Tags other than `think` inside the channel are
    markup and are dropped; outside it every id, tags included, passes on to the tool parser.
    """

    def __init__(self, tokenizer: TokenizerLike, *, start_in_reasoning: bool = True) -> None:
        self._lexer = XtmlLexer(tokenizer)
        self._text = TextStream(tokenizer)
        self._in_reasoning = start_in_reasoning

    @property
    def in_reasoning(self) -> bool:
        return self._in_reasoning

    def feed(self, ids: list[int]) -> tuple[str, list[int]]:
        reasoning: list[str] = []
        rest: list[int] = []
        for event in self._lexer.feed(ids):
            if isinstance(event, Tag) and event.name == "think":
                if self._in_reasoning:
                    reasoning.append(self._text.take(final=True))
                self._in_reasoning = not event.closing
            elif not self._in_reasoning:
                rest.extend(event.ids if isinstance(event, Tag) else event)
            elif not isinstance(event, Tag):
                self._text.push(event)
        reasoning.append(self._text.take())
        return "".join(reasoning), rest

    def finish(self) -> tuple[str, list[int]]:
        self._lexer.finish()
        return self._text.take(final=True), []


class K2ReasoningParser:
    """K2 / K2-Thinking: `<think>` and `</think>` are single special ids; the opener is optional.

    `start_in_reasoning` (thinking on) reads everything before `</think>` as reasoning, as vLLM's kimi_k2
    parser does; without it (thinking off) reasoning starts only at a `<think>` the model writes itself
    (K2-Thinking opens its think block on its own). Either way the markers never reach the content.
    Reasoning also ends implicitly where a tool-call section (or a bare tool call) begins, because the
    model sometimes omits `</think>` before calling tools; that id passes on to the tool parser.
    """

    def __init__(self, tokenizer: TokenizerLike, *, start_in_reasoning: bool = True) -> None:
        self._think = require_token_id(tokenizer, "<think>")
        self._end_think = require_token_id(tokenizer, "</think>")
        self._implicit_ends = {
            require_token_id(tokenizer, "<|tool_calls_section_begin|>"),
            require_token_id(tokenizer, "<|tool_call_begin|>"),
        }
        self._text = TextStream(tokenizer)
        self._in_reasoning = start_in_reasoning

    @property
    def in_reasoning(self) -> bool:
        return self._in_reasoning

    def feed(self, ids: list[int]) -> tuple[str, list[int]]:
        reasoning: list[str] = []
        rest: list[int] = []
        for token in ids:
            if token == self._think:
                self._in_reasoning = True
            elif token == self._end_think or (self._in_reasoning and token in self._implicit_ends):
                if self._in_reasoning:
                    reasoning.append(self._text.take(final=True))
                    self._in_reasoning = False
                if token != self._end_think:
                    rest.append(token)
            elif self._in_reasoning:
                self._text.push([token])
            else:
                rest.append(token)
        reasoning.append(self._text.take())
        return "".join(reasoning), rest

    def finish(self) -> tuple[str, list[int]]:
        return self._text.take(final=True), []
