"""Kimi K3 "XTML" chat encoding (docs/ARCHITECTURE.md §8.1), written as a program that emits segments.

A segment is (text, allow_special). Only markers allow special tokens; everything else (tag names,
attributes, message text, JSON) is tokenized with special matching off, so user text can never
produce a control token. The prompt's ids are the concatenation of the per-segment encodings.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from hyserve.tokenizer import Tokenizer

OPEN = "<|open|>"
CLOSE = "<|close|>"
SEP = "<|sep|>"
END_OF_MSG = "<|end_of_msg|>"
EOS = "[EOS]"
IMAGE_PLACEHOLDER = "<|media_pad|>"
THINKING_EFFORTS = ("low", "high", "max")
DEFAULT_THINKING_EFFORT = "max"

# Internal system-message bodies. Their wording is the checkpoint's (Moonshot's encoding_k3.py), byte
# for byte, because the model was trained on exactly these strings. The effort text names `medium`
# although it is rejected: that is the checkpoint's wording too.
_TOOLS_HEADER = "# Tools\nHere are the available tools, described in JSONSchema.\n\n"
_DYNAMIC_TOOLS_HEADER = (
    "## New Tools Available\n"
    "The system dynamically extends the toolset via lazy-loading.\n"
    "You have access to all existing and extended tools.\n"
    "Here are the specs for the extended tools.\n\n"
)
_EFFORT_BODY = (
    "`thinking_effort` guides on how much to think in your thinking channel (not including the "
    "response channel), supported values include `low`, `medium`, `high`, and `max`.\n"
    "Now the system is invoked with `thinking_effort={effort}`."
)
_TOOL_CHOICE_BODY = "The system is invoked with `tool_choice={choice}`.\nYou MUST {rule} in the next message."
_TOOL_CHOICE_RULES = {"required": "call tools", "none": "NOT call any tools"}
_RAW_JSON_RULE = (
    "Your response must be raw JSON data without markdown code blocks (```json) or any additional "
    "formatting."
)
_JSON_OBJECT_BODY = "The system is invoked with `response_format=json_object`.\n" + _RAW_JSON_RULE
_JSON_SCHEMA_BODY = (
    "The system is invoked with `response_format=json_schema`.\n" + _RAW_JSON_RULE + "\n"
    "The JSON data must match the following schema:\n```json\n{schema}\n```"
)

_POSITIONAL_CALL_ID = re.compile(r"(.*):(\d+)")


@dataclass(frozen=True)
class Segment:
    text: str
    allow_special: bool = False


# --- small helpers -------------------------------------------------------------------------------------

def deep_sort(value: Any) -> Any:
    """Sort every dict by key, recursively, so the same tools always give the same bytes."""
    if isinstance(value, dict):
        return {k: deep_sort(value[k]) for k in sorted(value)}
    if isinstance(value, list):
        return [deep_sort(v) for v in value]
    return value


def compact_json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def escape_attr(value: Any) -> str:
    # `&` first, so the `&` of `&quot;` is not escaped again.
    return str(value).replace("&", "&amp;").replace('"', "&quot;")


def unescape_attr(value: str) -> str:
    return value.replace("&quot;", '"').replace("&amp;", "&")


def _marker(text: str) -> Segment:
    return Segment(text, allow_special=True)


def _open(tag: str, *attrs: tuple[str, Any]) -> Iterator[Segment]:
    yield _marker(OPEN)
    yield Segment(tag)
    for key, value in attrs:
        yield from attribute_segments(key, value)
    yield _marker(SEP)


def attribute_segments(key: str, value: Any) -> Iterator[Segment]:
    """` key="value"` in the reference encoder's pieces: ` key`, `="`, the escaped value, `"`. Each piece is
    tokenized on its own, so the BPE pre-tokenizer never merges the quote into a value that starts or ends
    with punctuation (` key="_id"` is `="` + `_id`, not `="_` + `id`)."""
    yield Segment(f" {key}")
    yield Segment('="')
    yield from _text(escape_attr(value))
    yield Segment('"')


def _close(tag: str) -> Iterator[Segment]:
    yield _marker(CLOSE)
    yield Segment(tag)
    yield _marker(SEP)


def _text(text: Any) -> Iterator[Segment]:
    text = str(text)
    if text:
        yield Segment(text)


def _content(content: Any) -> Iterator[Segment]:
    if content is None:
        return
    if isinstance(content, str):
        yield from _text(content)
        return
    for part in content:
        if not isinstance(part, dict):
            raise ValueError(f"content parts must be objects like {{\"type\": \"text\", \"text\": ...}}, got {part!r}")
        kind = part.get("type")
        if kind in ("image", "image_url"):
            yield _marker(IMAGE_PLACEHOLDER)
        elif kind == "text" or "text" in part:
            yield from _text(part["text"])
        else:
            raise ValueError(f"unsupported content part type {kind!r}")


def _is_blank(content: Any) -> bool:
    return content is None or content == "" or content == []


def _end_message() -> Iterator[Segment]:
    yield from _close("message")
    yield _marker(END_OF_MSG)


def _internal_message(kind: str, body: str) -> Iterator[Segment]:
    yield from _open("message", ("role", "system"), ("type", kind))
    yield from _text(body.strip())
    yield from _end_message()


def _tool_declare(tools: Any, dynamic: bool = False) -> Iterator[Segment]:
    header = _DYNAMIC_TOOLS_HEADER if dynamic else _TOOLS_HEADER
    yield from _internal_message("tool-declare", f"{header}```json\n{compact_json(deep_sort(tools))}\n```")


# --- tool calls ----------------------------------------------------------------------------------------

def _function(call: dict) -> dict:
    """OpenAI nests name/arguments under `function`; a flat call dict is accepted as well."""
    return call.get("function", call)


def parse_arguments(arguments: Any) -> tuple[dict, str | None]:
    """(arguments as a dict, raw text to render as a json block when it does not parse)."""
    if arguments is None:
        return {}, None
    if isinstance(arguments, dict):
        return arguments, None
    if not isinstance(arguments, str):
        raise TypeError("tool call arguments must be a dict or a JSON object string")
    if not arguments.strip():
        return {}, None
    try:
        parsed = json.loads(arguments)
    except json.JSONDecodeError:
        return {}, arguments
    if not isinstance(parsed, dict):
        raise ValueError("tool call arguments must be a JSON object")
    return parsed, None


def argument_type(value: Any) -> str:
    # bool before number: bool is an int subclass in Python.
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, dict):
        return "object"
    return "array"


def argument_text(value: Any) -> str:
    # Default separators (", " / ": "), not compact ones: that is how the checkpoint saw arguments.
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _tool_calls(calls: Sequence[dict]) -> Iterator[Segment]:
    yield from _open("tools")
    for index, call in enumerate(calls, start=1):
        function = _function(call)
        yield from _open("call", ("tool", function["name"]), ("index", index))
        arguments, raw = parse_arguments(function.get("arguments"))
        if raw is not None:
            yield from _open("json", ("type", "object"))
            yield from _text(raw)
            yield from _close("json")
        for key, value in arguments.items():
            yield from _open("argument", ("key", key), ("type", argument_type(value)))
            yield from _text(argument_text(value))
            yield from _close("argument")
        yield from _close("call")
    yield from _close("tools")


def _speaker(role: str, message: dict) -> list[tuple[str, Any]]:
    """The `message` tag's attributes: the role, and the sender's `name` when the message has one."""
    return [("role", role)] + ([("name", message["name"])] if message.get("name") else [])


def _assistant(message: dict, thinking: bool) -> Iterator[Segment]:
    yield from _open("message", *_speaker("assistant", message))
    if thinking:
        yield from _open("think")
        reasoning = message.get("reasoning_content") or message.get("reasoning")
        if reasoning is not None and str(reasoning).strip():
            yield from _text(reasoning)
        yield from _close("think")
    yield from _open("response")
    yield from _content(message.get("content"))
    yield from _close("response")
    if message.get("tool_calls"):
        yield from _tool_calls(message["tool_calls"])
    yield from _end_message()


# --- tool results --------------------------------------------------------------------------------------

def _resolve_call(call_id: Any, calls: Sequence[dict]) -> int | None:
    """0-based position of the call a tool result answers, or None."""
    if call_id is None:
        return None
    for position, call in enumerate(calls):
        if call.get("id") is not None and str(call["id"]) == str(call_id):
            return position
    # vLLM also accepts `NAME:<0-based position>` ids.
    m = _POSITIONAL_CALL_ID.fullmatch(str(call_id))
    if m and int(m.group(2)) < len(calls) and _function(calls[int(m.group(2))]).get("name") == m.group(1):
        return int(m.group(2))
    return None


def order_tool_results(messages: Sequence[dict]) -> list[dict]:
    """Put each run of tool messages in call order, when every `tool_call_id` resolves.

    A resolved result also takes its tool name from the call it answers.
    """
    out: list[dict] = []
    calls: Sequence[dict] = ()
    i = 0
    while i < len(messages):
        message = messages[i]
        if message.get("role") != "tool":
            if message.get("role") == "assistant":
                calls = message.get("tool_calls") or ()
            out.append(message)
            i += 1
            continue
        run_end = i
        while run_end < len(messages) and messages[run_end].get("role") == "tool":
            run_end += 1
        run = messages[i:run_end]
        positions = [_resolve_call(m.get("tool_call_id", m.get("id")), calls) for m in run]
        if all(p is not None for p in positions):
            resolved = [
                {**m, "tool": _function(calls[p])["name"]} for p, m in zip(positions, run)
            ]
            out.extend(m for _, m in sorted(zip(positions, resolved), key=lambda pm: pm[0]))
        else:
            out.extend(run)
        i = run_end
    return out


# --- the prompt ----------------------------------------------------------------------------------------

def _messages(messages: Sequence[dict], thinking: bool) -> Iterator[Segment]:
    calls: Sequence[dict] = ()
    tool_index = 0
    for message in order_tool_results(messages):
        role = message.get("role")
        if role == "developer":
            role = "system"  # OpenAI's newer name for the system role
        if role == "system" and message.get("tools"):
            # A dynamic declaration, then the message's own text (when it has any).
            yield from _tool_declare(message["tools"], dynamic=True)
            if _is_blank(message.get("content")):
                continue
        if role in ("system", "user"):
            yield from _open("message", *_speaker(role, message))
            yield from _content(message.get("content"))
            yield from _end_message()
        elif role == "assistant":
            calls = message.get("tool_calls") or ()
            tool_index = 0
            yield from _assistant(message, thinking)
        elif role == "tool":
            tool_index += 1
            name = message.get("tool") or message.get("name")
            if not name and tool_index <= len(calls):
                name = _function(calls[tool_index - 1]).get("name")
            if not name:
                raise ValueError("a tool message has no tool name and no matching call")
            yield from _open("message", ("role", "tool"), ("tool", name), ("index", tool_index))
            yield from _content(message.get("content"))
            yield from _end_message()
        else:
            raise ValueError(f"unsupported message role {role!r}")


def _response_schema(response_format: dict) -> Any:
    schema = response_format.get("json_schema")
    if isinstance(schema, dict):
        return schema.get("schema", schema.get("json_schema", schema))
    return schema


def render_k3(
    messages: Sequence[dict],
    tools: Sequence[dict] | None = None,
    *,
    thinking: bool = True,
    thinking_effort: str | None = None,
    tool_choice: Any = None,
    response_format: Any = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
) -> list[Segment]:
    """The K3 prompt as segments. Raises ValueError for an unsupported effort or malformed input.

    `continue_final_message` leaves the last (assistant) message open inside its response, so the
    generation continues its content; internal messages then go before that message.
    """
    effort = DEFAULT_THINKING_EFFORT if thinking_effort is None else thinking_effort
    if thinking and effort not in THINKING_EFFORTS:
        raise ValueError(
            f"unsupported thinking_effort={effort!r}; supported values are {list(THINKING_EFFORTS)}"
        )
    segments: list[Segment] = []
    if tools:
        segments += _tool_declare(list(tools))
    if thinking:
        segments += _internal_message("thinking-effort", _EFFORT_BODY.format(effort=effort))
    final = check_continuable(messages, add_generation_prompt) if continue_final_message else None
    segments += _messages(messages[:-1] if final is not None else messages, thinking)
    if isinstance(tool_choice, str) and tool_choice in _TOOL_CHOICE_RULES:
        body = _TOOL_CHOICE_BODY.format(choice=tool_choice, rule=_TOOL_CHOICE_RULES[tool_choice])
        segments += _internal_message("tool-choice", body)
    format_type = response_format.get("type") if isinstance(response_format, dict) else response_format
    if format_type == "json_object":
        segments += _internal_message("response-format", _JSON_OBJECT_BODY)
    elif format_type == "json_schema":
        schema = compact_json(deep_sort(_response_schema(response_format)))
        segments += _internal_message("response-format", _JSON_SCHEMA_BODY.format(schema=schema))
    if final is not None:
        # The whole message but its closing tags: think (if any) is closed, the response left open.
        segments += _open("message", *_speaker("assistant", final))
        if thinking:
            segments += _open("think")
            reasoning = final.get("reasoning_content") or final.get("reasoning")
            if reasoning is not None and str(reasoning).strip():
                segments += _text(reasoning)
            segments += _close("think")
        segments += _open("response")
        segments += _content(final.get("content"))
    elif add_generation_prompt:
        segments += _open("message", ("role", "assistant"))
        segments += _open("think" if thinking else "response")
    return segments


def check_continuable(messages: Sequence[dict], add_generation_prompt: bool) -> dict:
    """The final message that `continue_final_message` continues; ValueError when there is none."""
    if add_generation_prompt:
        raise ValueError("continue_final_message needs add_generation_prompt=false")
    if not messages or messages[-1].get("role") != "assistant":
        raise ValueError("continue_final_message needs the last message to be an assistant message")
    if messages[-1].get("tool_calls"):
        raise ValueError("continue_final_message cannot continue an assistant message with tool_calls")
    return messages[-1]


def render_text(segments: Sequence[Segment]) -> str:
    """The prompt as text, for display and tests only: never re-tokenize it (see module docstring)."""
    return "".join(s.text for s in segments)


def encode_segments(tokenizer: Tokenizer, segments: Sequence[Segment]) -> list[int]:
    ids: list[int] = []
    for segment in segments:
        ids += tokenizer.encode(segment.text, allow_special=segment.allow_special)
    return ids


def encode_k3(
    tokenizer: Tokenizer,
    messages: Sequence[dict],
    tools: Sequence[dict] | None = None,
    **kwargs: Any,
) -> list[int]:
    """Token ids of the K3 prompt; kwargs are those of `render_k3`."""
    return encode_segments(tokenizer, render_k3(messages, tools, **kwargs))
