"""Kimi K2 / K2-Thinking / Kimi Linear chat encoding (docs/ARCHITECTURE.md §8.1), as a segment program.

Every marker is one special token. The shipped Jinja templates render a string and tokenize it whole,
so here the text between two markers is merged into one segment before tokenizing: that gives the
template's token ids, while text can still never turn into a marker.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any

from hyserve.entrypoints.chat.k3_encoding import (
    Segment,
    check_continuable,
    compact_json,
    deep_sort,
    encode_segments,
)
from hyserve.tokenizer import Tokenizer

IM_END = "<|im_end|>"
IM_MIDDLE = "<|im_middle|>"
IM_USER = "<|im_user|>"
IM_ASSISTANT = "<|im_assistant|>"
IM_SYSTEM = "<|im_system|>"
EOS = "[EOS]"
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
SECTION_BEGIN = "<|tool_calls_section_begin|>"
SECTION_END = "<|tool_calls_section_end|>"
CALL_BEGIN = "<|tool_call_begin|>"
CALL_ARGUMENT_BEGIN = "<|tool_call_argument_begin|>"
CALL_END = "<|tool_call_end|>"

DEFAULT_SYSTEM_PROMPT = "You are Kimi, an AI assistant created by Moonshot AI."
_ROLE_MARKERS = {"user": IM_USER, "assistant": IM_ASSISTANT}


def _marker(text: str) -> Segment:
    return Segment(text, allow_special=True)


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if part.get("type") in ("image", "image_url") or "image_url" in part:
            raise ValueError("the K2 / Kimi Linear encoding here is text-only")
        parts.append(part["text"])
    return "".join(parts)


def _turn_open(role: str, name: str | None) -> Iterator[Segment]:
    yield _marker(_ROLE_MARKERS.get(role, IM_SYSTEM))
    yield Segment(name or role)
    yield _marker(IM_MIDDLE)


class _CallIds:
    """Call ids in a conversation: stored ids are re-rendered; missing ones are `functions.NAME:IDX`.

    IDX counts every call of the conversation from 0 (**hyserve:** the template counts only calls it
    names itself, which can repeat an IDX when histories mix both kinds).
    """

    def __init__(self) -> None:
        self.count = 0
        self.pending: deque[str] = deque()

    def name_call(self, call: dict) -> str:
        function = call.get("function", call)
        call_id = call.get("id") or f"functions.{function['name']}:{self.count}"
        self.count += 1
        self.pending.append(call_id)
        return call_id

    def answer(self, message: dict) -> str:
        # Results are matched to calls in call order, as the template does.
        if self.pending:
            return self.pending.popleft()
        return f"functions.{message.get('name') or 'unknown'}:{self.count}"


def next_call_index(messages: Sequence[dict]) -> int:
    """The IDX of the next generated call: every call of the history counts once, as in `_CallIds`."""
    return sum(len(m.get("tool_calls") or ()) for m in messages if m.get("role") == "assistant")


def _arguments_text(arguments: Any) -> str:
    if arguments is None:
        return "{}"
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def _assistant_body(message: dict, think: str | None, ids: _CallIds) -> Iterator[Segment]:
    if think is not None:
        yield _marker(THINK_OPEN)
        yield Segment(think)
        yield _marker(THINK_CLOSE)
    yield Segment(_content_text(message.get("content")))
    calls = message.get("tool_calls") or ()
    if calls:
        yield _marker(SECTION_BEGIN)
        for call in calls:
            yield _marker(CALL_BEGIN)
            yield Segment(ids.name_call(call))
            yield _marker(CALL_ARGUMENT_BEGIN)
            yield Segment(_arguments_text(call.get("function", call).get("arguments")))
            yield _marker(CALL_END)
        yield _marker(SECTION_END)


def _last_final_answer(messages: Sequence[dict]) -> int:
    """Index of the last assistant turn without tool calls (-1 if none): the K2-Thinking split point."""
    for i in range(len(messages) - 1, -1, -1):
        if messages[i].get("role") == "assistant" and not messages[i].get("tool_calls"):
            return i
    return -1


def render_k2(
    messages: Sequence[dict],
    tools: Sequence[dict] | None = None,
    *,
    thinking: bool = False,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
) -> list[Segment]:
    """The K2 prompt as segments; `thinking` selects the K2-Thinking rendering of assistant turns.
    `continue_final_message` leaves the last (assistant) turn open, so the generation continues it.

    With thinking, turns up to the last final answer keep an empty think block (their reasoning is
    dropped) and the live tool loop after it keeps its reasoning.
    """
    segments: list[Segment] = []
    if tools:
        segments += [_marker(IM_SYSTEM), Segment("tool_declare"), _marker(IM_MIDDLE)]
        segments += [Segment(compact_json(deep_sort(list(tools)))), _marker(IM_END)]
    if not messages or messages[0].get("role") != "system":
        segments += _turn_open("system", None)
        segments += [Segment(DEFAULT_SYSTEM_PROMPT), _marker(IM_END)]
    if continue_final_message:
        check_continuable(messages, add_generation_prompt)
    split = _last_final_answer(messages)
    ids = _CallIds()
    for i, message in enumerate(messages):
        role = message.get("role")
        segments += _turn_open(role, message.get("name"))
        if role == "assistant":
            think = None
            if thinking:
                reasoning = message.get("reasoning_content") or message.get("reasoning") or ""
                think = "" if i <= split else str(reasoning)
            segments += _assistant_body(message, think, ids)
        elif role == "tool":
            segments.append(Segment(f"## Return of {ids.answer(message)}\n"))
            segments.append(Segment(_content_text(message.get("content"))))
        else:
            segments.append(Segment(_content_text(message.get("content"))))
        if continue_final_message and i == len(messages) - 1:
            break  # the turn stays open: no end marker
        segments.append(_marker(IM_END))
    if add_generation_prompt:
        segments += _turn_open("assistant", None)
    return merge_text_segments(segments)


def merge_text_segments(segments: Sequence[Segment]) -> list[Segment]:
    """Join neighbouring plain-text segments and drop empty ones (markers are kept as they are)."""
    merged: list[Segment] = []
    for segment in segments:
        if not segment.text:
            continue
        if merged and not segment.allow_special and not merged[-1].allow_special:
            merged[-1] = Segment(merged[-1].text + segment.text)
        else:
            merged.append(segment)
    return merged


def encode_k2(
    tokenizer: Tokenizer,
    messages: Sequence[dict],
    tools: Sequence[dict] | None = None,
    **kwargs: Any,
) -> list[int]:
    """Token ids of the K2 prompt; kwargs are those of `render_k2`."""
    return encode_segments(tokenizer, render_k2(messages, tools, **kwargs))
