"""Responses API items <-> chat messages: what a create request asks, as the chat request that runs it.

Input items become chat messages (consecutive reasoning, assistant message and function_call items are one
assistant turn, in that order, as the model wrote them), so a turn sent back as items renders to the same
prompt ids as the stored turn a `previous_response_id` points to, and both hit the prefix cache.
"""

from __future__ import annotations

import base64
from typing import Any

from pydantic import ValidationError

from hyserve.entrypoints.openai.errors import validation_message
from hyserve.entrypoints.openai.protocol import APIError, ChatCompletionRequest
from hyserve.entrypoints.openai.protocol_responses import (
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionTool,
    InputItem,
    MessageItem,
    ReasoningItem,
    Refusal,
    ResponsesRequest,
    TextFormatJSONObject,
    TextFormatJSONSchema,
    TextFormatText,
    ToolChoiceFunction,
)
from hyserve.entrypoints.strict_models import Unsupported

# Chat's field names in errors, said in this API's words.
CHAT_PARAMS = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text.format"}
_ENCRYPTED_PREFIX = "hyserve:"
_RANK = {"reasoning": 0, "content": 1, "tool_calls": 2}  # the order of an assistant turn's parts


def encrypt_reasoning(text: str) -> str:
    """`encrypted_content` of a reasoning item: an opaque carrier (the reasoning is not secret here), so
    stateless clients (store: false) can send the reasoning back and keep the prefix cache warm."""
    return _ENCRYPTED_PREFIX + base64.b64encode(text.encode()).decode()


def _decrypt_reasoning(blob: str, where: str) -> str:
    try:
        if not blob.startswith(_ENCRYPTED_PREFIX):
            raise ValueError
        return base64.b64decode(blob[len(_ENCRYPTED_PREFIX):], validate=True).decode()
    except ValueError:
        raise APIError(400, f"{where}.encrypted_content was not produced by this server", param="input") from None


def _text_parts(content: str | list, where: str) -> str | list[dict]:
    if isinstance(content, str):
        return content
    parts = []
    for j, part in enumerate(content):
        if isinstance(part, Unsupported):
            raise APIError(400, f"{where}.content[{j}]: content of type {part.type!r} is not supported; this "
                           "server accepts text only (no images, files or audio)", param="input")
        parts.append({"type": "text", "text": part.refusal if isinstance(part, Refusal) else part.text})
    return parts


def _joined(content: str | list, where: str) -> str:
    parts = _text_parts(content, where)
    return parts if isinstance(parts, str) else "".join(p["text"] for p in parts)


def _assistant_turn(messages: list[dict], part: str) -> dict:
    """The assistant message `part` belongs to: the last one, unless it already holds a later part."""
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant":
        held = [r for name, r in _RANK.items() if last.get(name) not in (None, "", [])]
        if not held or max(held) < _RANK[part] or (part == "tool_calls" and max(held) == _RANK[part]):
            return last
    messages.append({"role": "assistant", "content": ""})
    return messages[-1]


def _reasoning_text(item: ReasoningItem, where: str) -> str:
    if item.content:
        return "".join(c.text for c in item.content)
    if item.encrypted_content:
        return _decrypt_reasoning(item.encrypted_content, where)
    return "\n\n".join(s.text for s in item.summary)


def input_messages(items: str | list[InputItem]) -> list[dict]:
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if isinstance(item, MessageItem) and item.role == "assistant":
            turn = _assistant_turn(out, "content")
            turn["content"] += _joined(item.content, where)
        elif isinstance(item, MessageItem):
            out.append({"role": item.role, "content": _text_parts(item.content, where)})
        elif isinstance(item, ReasoningItem):
            _assistant_turn(out, "reasoning")["reasoning"] = _reasoning_text(item, where)
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            _assistant_turn(out, "tool_calls").setdefault("tool_calls", []).append(call)
        elif isinstance(item, FunctionCallOutputItem):
            message = {"role": "tool", "tool_call_id": item.call_id, "content": _text_parts(item.output, where)}
            if item.name:
                message["name"] = item.name
            out.append(message)
        else:
            raise APIError(400, f"{where}: input items of type {item.type!r} are not supported; this server takes "
                           "message, function_call, function_call_output and reasoning items", param="input")
    return out


def chat_tools(req: ResponsesRequest) -> list[dict]:
    tools = []
    for i, tool in enumerate(req.tools):
        if not isinstance(tool, FunctionTool):
            raise APIError(400, f"tools[{i}]: tools of type {tool.type!r} are not supported; this server runs "
                           "function tools only", param="tools")
        function = {"name": tool.name}
        if tool.description is not None:
            function["description"] = tool.description
        if tool.parameters is not None:
            function["parameters"] = tool.parameters
        tools.append({"type": "function", "function": function})
    return tools


def chat_tool_choice(req: ResponsesRequest) -> str | dict | None:
    choice = req.tool_choice
    if choice is None or isinstance(choice, str):
        return choice
    if isinstance(choice, ToolChoiceFunction):
        return {"type": "function", "function": {"name": choice.name}}
    raise APIError(400, f"tool_choice of type {choice.type!r} is not supported; use none, auto, required or "
                   "{\"type\": \"function\", \"name\": ...}", param="tool_choice")


def chat_response_format(req: ResponsesRequest) -> dict | None:
    text = req.text
    if text is None:
        return None
    fmt = text.format
    if fmt is None or isinstance(fmt, TextFormatText):
        return None
    if isinstance(fmt, TextFormatJSONObject):
        return {"type": "json_object"}
    if isinstance(fmt, TextFormatJSONSchema):
        return {"type": "json_schema", "json_schema": {"name": fmt.name, "schema": fmt.schema_}}
    raise APIError(400, f"text.format of type {fmt.type!r} is not supported; use text, json_object or json_schema",
                   param="text.format")


def chat_request(req: Any, messages: list[dict], stream: bool = False) -> ChatCompletionRequest:
    """The chat request that runs a Responses request (`req` may also be an InputTokensRequest)."""
    body: dict[str, Any] = {
        "model": req.model, "messages": messages, "tools": chat_tools(req) or None,
        "tool_choice": chat_tool_choice(req), "parallel_tool_calls": req.parallel_tool_calls is not False,
        "response_format": chat_response_format(req), "stream": stream,
    }
    if req.reasoning is not None and req.reasoning.effort is not None:
        body["reasoning_effort"] = req.reasoning.effort
    for name, chat_name in (("max_output_tokens", "max_tokens"), ("temperature", "temperature"), ("top_p", "top_p")):
        if getattr(req, name, None) is not None:
            body[chat_name] = getattr(req, name)
    try:
        return ChatCompletionRequest(**body)
    except ValidationError as e:  # what the chat path refuses, named in this API's words
        raise APIError(400, *validation_message(e, rename=CHAT_PARAMS)) from e
