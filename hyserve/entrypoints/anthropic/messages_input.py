"""An Anthropic Messages request as the chat request that runs it.

Messages map onto chat messages the way a chat client writes a tool loop: an assistant message's
thinking, text and tool_use blocks are one assistant turn (reasoning, content, tool_calls); a user
message's tool_result blocks are tool messages (in order, before the user's own text). So a turn sent back
renders to the prompt ids the chat path would build, and the next turn hits the prefix cache.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError

from hyserve.entrypoints.anthropic.protocol import (
    CountTokensRequest,
    MessagesRequest,
    TextBlock,
    ThinkingAdaptive,
    ThinkingBlock,
    ThinkingEnabled,
    Tool,
    ToolChoiceAny,
    ToolChoiceAuto,
    ToolChoiceNone,
    ToolChoiceTool,
    ToolResultBlock,
    ToolUseBlock,
)
from hyserve.entrypoints.openai.errors import validation_message
from hyserve.entrypoints.openai.protocol import APIError, ChatCompletionRequest

# Chat's field names in errors, said in this API's words.
CHAT_PARAMS = {"stop": "stop_sequences", "response_format": "output_config.format",
               "reasoning_effort": "output_config.effort"}


def _unsupported(where: str, kind: str | None) -> APIError:
    what = "content blocks" if kind else "content"
    return APIError(400, f"{where}: {what} of type {kind!r} are not supported; this server takes text, "
                    "tool_use, tool_result and thinking blocks (no images, documents or server tools)")


def _text_parts(blocks: list, where: str) -> list[dict]:
    parts = []
    for j, block in enumerate(blocks):
        if not isinstance(block, TextBlock):
            raise _unsupported(f"{where}.content.{j}", block.type)
        parts.append({"type": "text", "text": block.text})
    return parts


def _user(blocks: list, where: str) -> list[dict]:
    """Tool results first (as tool messages), then the user's text, as one user message."""
    out, text = [], []
    for j, block in enumerate(blocks):
        if isinstance(block, ToolResultBlock):
            content = block.content if isinstance(block.content, str) or block.content is None else \
                _text_parts(block.content, f"{where}.content.{j}")
            out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": content or ""})
        elif isinstance(block, TextBlock):
            text.append({"type": "text", "text": block.text})
        else:
            raise _unsupported(f"{where}.content.{j}", block.type)
    return out + ([{"role": "user", "content": text}] if text else [])


def _assistant(blocks: list, where: str) -> dict:
    reasoning, text, calls = [], [], []
    for j, block in enumerate(blocks):
        if isinstance(block, ThinkingBlock):
            reasoning.append(block.thinking)
        elif isinstance(block, TextBlock):
            text.append(block.text)
        elif isinstance(block, ToolUseBlock):
            arguments = json.dumps(block.input, ensure_ascii=False)
            calls.append({"id": block.id, "type": "function", "function": {"name": block.name, "arguments": arguments}})
        else:
            raise _unsupported(f"{where}.content.{j}", block.type)
    message: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
    if reasoning:
        message["reasoning"] = "".join(reasoning)
    if calls:
        message["tool_calls"] = calls
    return message


def chat_messages(req: CountTokensRequest) -> list[dict]:
    out: list[dict] = []
    if req.system is not None:
        system = req.system if isinstance(req.system, str) else _text_parts(req.system, "system")
        out.append({"role": "system", "content": system})
    for i, m in enumerate(req.messages):
        where = f"messages.{i}"
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
        elif m.role == "assistant":
            out.append(_assistant(m.content, where))
        elif m.role == "user":
            out.extend(_user(m.content, where))
        else:
            out.append({"role": "system", "content": _text_parts(m.content, where)})
    return out


def _tools(req: CountTokensRequest) -> list[dict] | None:
    tools = []
    for i, tool in enumerate(req.tools or []):
        if not isinstance(tool, Tool):
            raise APIError(400, f"tools.{i}: tools of type {tool.type!r} are not supported; this server runs "
                           "custom (client) tools only")
        function: dict[str, Any] = {"name": tool.name}
        if tool.description is not None:
            function["description"] = tool.description
        function["parameters"] = tool.input_schema
        tools.append({"type": "function", "function": function})
    return tools or None


def _tool_choice(req: CountTokensRequest) -> tuple[Any, bool]:
    """(chat tool_choice, parallel tool calls allowed)."""
    choice = req.tool_choice
    parallel = not getattr(choice, "disable_parallel_tool_use", None)
    if choice is None or isinstance(choice, ToolChoiceAuto):
        return (None if choice is None else "auto"), parallel
    if isinstance(choice, ToolChoiceAny):
        return "required", parallel
    if isinstance(choice, ToolChoiceTool):
        return {"type": "function", "function": {"name": choice.name}}, parallel
    if isinstance(choice, ToolChoiceNone):
        return "none", parallel
    raise APIError(400, f"tool_choice of type {choice.type!r} is not supported; use auto, any, tool or none")


def _thinking(req: CountTokensRequest) -> bool:
    """Thinking is off unless asked for, as in Anthropic's API."""
    thinking = req.thinking
    if isinstance(thinking, ThinkingEnabled):
        if isinstance(req, MessagesRequest) and thinking.budget_tokens >= req.max_tokens:
            raise APIError(400, f"thinking.budget_tokens ({thinking.budget_tokens}) must be less than max_tokens "
                           f"({req.max_tokens})")
        return True
    if thinking is None or thinking.type == "disabled":
        return False
    if isinstance(thinking, ThinkingAdaptive):
        return True
    raise APIError(400, f"thinking of type {thinking.type!r} is not supported; use enabled, adaptive or disabled")


def chat_request(req: CountTokensRequest, stream: bool = False) -> ChatCompletionRequest:
    """The chat request that runs a Messages (or count_tokens) request."""
    messages = chat_messages(req)
    choice, parallel = _tool_choice(req)
    prefill = req.messages[-1].role == "assistant"
    if prefill and messages[-1].get("tool_calls"):
        raise APIError(400, "the final assistant message has tool_use blocks: send their tool_result blocks in a "
                       "user message")
    body: dict[str, Any] = {
        "model": req.model, "messages": messages, "tools": _tools(req), "tool_choice": choice,
        "parallel_tool_calls": parallel, "stream": stream,
        "chat_template_kwargs": {"thinking": _thinking(req)},
        # A final assistant message is a prefill: the answer continues it.
        "add_generation_prompt": not prefill, "continue_final_message": prefill,
    }
    out = req.output_config
    if out is not None and out.effort is not None:
        body["reasoning_effort"] = out.effort
    if out is not None and out.format is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": out.format.schema_}}
    if isinstance(req, MessagesRequest):
        body.update(max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                    stop=req.stop_sequences, user=req.metadata.user_id if req.metadata else None)
    try:
        return ChatCompletionRequest(**body)
    except ValidationError as e:  # what the chat path refuses, named in this API's words
        raise APIError(400, *validation_message(e, rename=CHAT_PARAMS)) from e
