"""POST /v1/chat/completions: render with the family's encoder, generate, parse reasoning and tool calls.

Outputs are parsed on token ids (never on rendered text), with one `OutputParser` per completion; the
streaming and non-streaming paths run the same parser, so their results agree (docs/ARCHITECTURE.md §8.2).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from hyserve.entrypoints.chat import ChatEncoder, chat_output_parser, get_chat_encoder
from hyserve.entrypoints.chat.tool_calls import Delta
from hyserve.entrypoints.openai.forced_tools import forced_tool_call_spec, response_format_spec
from hyserve.entrypoints.openai.protocol import APIError, ChatCompletionRequest
from hyserve.entrypoints.openai.serving_common import (
    ServerState,
    build_params,
    check_request,
    collect,
    error_event,
    merge,
    new_id,
    prompt_logprobs_json,
    resolve_max_tokens,
    sse,
    structured_constraint,
    submit,
    truncate_prompt,
    usage,
    usage_flags,
)


def _tool_functions(req: ChatCompletionRequest) -> list[dict]:
    out = []
    for tool in req.tools or []:
        fn = tool.get("function") if isinstance(tool, dict) else None
        if tool.get("type", "function") != "function" or not isinstance(fn, dict) or not fn.get("name"):
            raise APIError(400, "each tool must be {\"type\": \"function\", \"function\": {\"name\": ...}}",
                           param="tools")
        out.append(fn)
    return out


def _tool_choice(req: ChatCompletionRequest, functions: list[dict]) -> tuple[str, list[dict]]:
    """("none" | "auto" | "required", the functions a forced call may use)."""
    choice = req.tool_choice
    if choice is None:
        return ("auto" if functions else "none"), functions
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise APIError(400, f"tool_choice must be none, auto, required or a named function, got {choice!r}",
                           param="tool_choice")
        if choice == "required" and not functions:
            raise APIError(400, "tool_choice 'required' needs at least one tool", param="tool_choice")
        return choice, functions
    fn = choice.get("function") if choice.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str) or not name:
        raise APIError(400, "a named tool_choice must be {\"type\": \"function\", \"function\": {\"name\": ...}}",
                       param="tool_choice")
    named = [f for f in functions if f["name"] == name]
    if not named:
        raise APIError(400, f"tool_choice names function {name!r}, which is not in tools", param="tool_choice")
    return "required", named


def _chat_logprobs(state: ServerState, token_ids: list[int], entries: list[dict] | None,
                   k: int | None) -> list[dict] | None:
    if k is None or entries is None:
        return None
    out = []
    for tid, entry in zip(token_ids, entries):
        text = state.tokenizer.decode([tid], skip_special_tokens=False)
        ranked = sorted((lp for lp in entry.values() if lp.rank is not None and lp.rank <= k), key=lambda x: x.rank)
        out.append({
            "token": text, "logprob": entry[tid].logprob if tid in entry else None, "bytes": list(text.encode()),
            "top_logprobs": [{"token": lp.decoded_token, "logprob": lp.logprob,
                              "bytes": list((lp.decoded_token or "").encode())} for lp in ranked][:k],
        })
    return out


class _StopTrim:
    """Stop strings for chat. The engine ends the completion when one appears, but the parsers work on
    token ids, which still hold the stop text; so streamed text keeps back the last `len(stop) - 1`
    characters of each field until the end, where a matched stop string is cut off."""

    def __init__(self, stops: list[str], keep: bool) -> None:
        self.stops, self.keep = stops, keep
        self.holdback = max((len(x) for x in stops), default=1) - 1
        self.pending = {"reasoning": "", "content": ""}

    def push(self, delta: Delta) -> Delta:
        if not self.stops:
            return delta
        out = {}
        for name in ("reasoning", "content"):
            text = getattr(delta, name)
            if name == "content" and text and self.pending["reasoning"]:
                out["reasoning"] = (out.get("reasoning") or "") + self.pending["reasoning"]
                self.pending["reasoning"] = ""
            if text:
                buf = self.pending[name] + text
                cut = max(0, len(buf) - self.holdback)
                self.pending[name] = buf[cut:]
                if cut:
                    out[name] = (out.get(name) or "") + buf[:cut]
        return Delta(out.get("reasoning"), out.get("content"), delta.tool_calls)

    def finish(self, delta: Delta, stop_reason: Any) -> Delta:
        if not self.stops:
            return delta
        released = self.push(delta)
        out = {"reasoning": released.reasoning, "content": released.content}
        for name in ("reasoning", "content"):
            tail, self.pending[name] = self.pending[name], ""
            if tail:
                out[name] = (out[name] or "") + tail
        if isinstance(stop_reason, str) and not self.keep:
            for name in ("content", "reasoning"):
                text = out[name]
                if text is not None and (i := text.rfind(stop_reason)) >= 0:
                    out[name] = text[:i] or None
                    break
        return Delta(out["reasoning"], out["content"], released.tool_calls)


class _Completion:
    """Per-choice state while a chat completion runs."""

    def __init__(self, state: ServerState, encoder: ChatEncoder, kwargs: dict[str, Any], tool_names: list[str],
                 tools_enabled: bool, stop: _StopTrim | None = None) -> None:
        self.parser = chat_output_parser(encoder, state.tokenizer, kwargs, tool_names=tool_names,
                                         tools_enabled=tools_enabled)
        self.ids: list[int] = []
        self.logprobs: list[dict] = []
        self.finish: str | None = None
        self.stop: Any = None
        self.sent_role = False
        self.called = False
        self.trim = stop or _StopTrim([], False)

    def advance(self, c: Any) -> Delta:
        """Feed one engine delta of this completion: what it releases, stop strings trimmed."""
        self.ids += c.token_ids
        delta = self.parser.feed(c.token_ids)
        if c.finish_reason:
            self.finish, self.stop = c.finish_reason, c.stop_reason
            tail = self.parser.finish()
            delta = Delta(_cat(delta.reasoning, tail.reasoning), _cat(delta.content, tail.content),
                          delta.tool_calls + tail.tool_calls)
            return self.trim.finish(delta, self.stop)
        return self.trim.push(delta)


def _finish_reason(c: _Completion) -> str | None:
    if c.finish == "stop" and c.called:
        return "tool_calls"
    return c.finish


@dataclass
class ChatPrompt:
    """A chat request rendered to prompt ids, with what rendering decided."""

    ids: list[int]
    encoder: Any
    kwargs: dict[str, Any]
    functions: list[dict]
    choice: str
    forced: list[dict]


@dataclass
class ChatRun:
    """A submitted chat request: its engine stream and one `_Completion` per choice."""

    rid: str
    ids: list[int]
    stream: Any
    comps: list[_Completion]
    k: int | None


def render_chat_prompt(state: ServerState, req: ChatCompletionRequest) -> ChatPrompt:
    """Validate a chat request and render its prompt (the ids /v1/chat/completions would submit)."""
    state.check_model(req.model)
    check_request(state, req)
    # skip_special_tokens needs no handling: the output parsers always read the special ids (an active parser
    # keeps special tokens in: docs/ARCHITECTURE.md §8.2), so clients that send false get what they asked for
    _reject_images(req.messages)
    encoder = get_chat_encoder(state.chat_encoding)
    functions = _tool_functions(req)
    choice, forced = _tool_choice(req, functions)
    kwargs: dict[str, Any] = dict(req.chat_template_kwargs or {})
    kwargs.setdefault("add_generation_prompt", req.add_generation_prompt)
    kwargs.setdefault("continue_final_message", req.continue_final_message)
    if kwargs["continue_final_message"] and kwargs["add_generation_prompt"]:
        raise APIError(400, "continue_final_message needs add_generation_prompt=false",
                       param="continue_final_message")
    if req.reasoning_effort is not None:
        kwargs.setdefault("reasoning_effort", req.reasoning_effort)
    if req.tool_choice is not None:
        kwargs.setdefault("tool_choice", choice)
    if req.response_format is not None:
        kwargs.setdefault("response_format", req.response_format.model_dump(exclude_none=True))
    try:
        ids = encoder.encode(state.tokenizer, req.messages, req.tools or None, **kwargs)
    # AttributeError: a list where a dict belongs; RecursionError: tool-call arguments (a JSON string) nested deep
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
        raise APIError(400, f"invalid messages: {e}", param="messages") from e
    ids = truncate_prompt(state, req, ids)
    return ChatPrompt(ids, encoder, kwargs, functions, choice, forced)


async def start_chat_completion(state: ServerState, req: ChatCompletionRequest,
                                id_prefix: str = "chatcmpl") -> ChatRun:
    """Render, build the sampling parameters (forced tool calls, structured outputs) and submit."""
    p = render_chat_prompt(state, req)
    ids, encoder, kwargs, functions, choice, forced = p.ids, p.encoder, p.kwargs, p.functions, p.choice, p.forced
    stop_ids = encoder.stop_token_ids(state.tokenizer)
    spec = None
    if choice == "required":
        spec = forced_tool_call_spec(encoder, state.tokenizer, forced, req.messages,
                                     parallel=req.parallel_tool_calls, kwargs=kwargs)
    elif (constraint := structured_constraint(req)) is not None:
        spec = response_format_spec(encoder, state.tokenizer, constraint[0], constraint[1], kwargs)
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    max_tokens = resolve_max_tokens(state, len(ids), requested, None)
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
    k = (req.top_logprobs or 0) if req.logprobs else None
    # The parsers need the markers: special tokens stay in (docs/ARCHITECTURE.md §8.2).
    # ignore_eos (benchmarks asking for exact output lengths) also ignores the end-of-message markers.
    params = build_params(req, max_tokens=max_tokens, logprobs=k, stop_token_ids=[] if req.ignore_eos else stop_ids,
                          structured=spec, skip_special_tokens=False, prompt_logprobs=req.prompt_logprobs)
    rid = new_id(id_prefix)
    stream = await submit(state, rid, ids, params, req)
    tools_enabled = bool(functions) and choice != "none"
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    names = [f["name"] for f in functions]
    comps = [_Completion(state, encoder, kwargs, names, tools_enabled, _StopTrim(stops, req.include_stop_str_in_output))
             for _ in range(req.n)]
    return ChatRun(rid, ids, stream, comps, k)


async def create_chat_completion(state: ServerState, req: ChatCompletionRequest, request: Request):
    run = await start_chat_completion(state, req)
    rid, ids, stream, comps, k = run.rid, run.ids, run.stream, run.comps, run.k
    created = int(time.time())
    if req.stream:
        gen = _stream(state, req, rid, created, ids, stream, comps, k)
        return StreamingResponse(gen, media_type="text/event-stream")
    (deltas,) = await collect([stream], request)
    cached, prompt_lps = 0, None
    for d in deltas:
        cached = d.num_cached_tokens if d.finished else cached
        prompt_lps = d.prompt_logprobs if d.prompt_logprobs is not None else prompt_lps
        for c in d.completions:
            comp = comps[c.index]
            comp.ids += c.token_ids
            comp.logprobs += c.logprobs or []
            if c.finish_reason:
                comp.finish, comp.stop = c.finish_reason, c.stop_reason
    choices = []
    for i, comp in enumerate(comps):
        parsed = comp.parser.parse(comp.ids)
        trimmed = comp.trim.finish(Delta(parsed.reasoning, parsed.content), comp.stop)
        parsed.reasoning, parsed.content = trimmed.reasoning, trimmed.content
        comp.called = bool(parsed.tool_calls)
        message: dict[str, Any] = {"role": "assistant", "content": parsed.content, "reasoning": parsed.reasoning,
                                   "tool_calls": [t.to_openai() for t in parsed.tool_calls]}
        if state.emit_reasoning_content:
            message["reasoning_content"] = parsed.reasoning
        choice = {"index": i, "message": message, "logprobs": _logprobs_block(state, comp, k),
                  "finish_reason": _finish_reason(comp) or "abort", "stop_reason": comp.stop}
        if req.return_token_ids:
            choice["token_ids"] = comp.ids
        choices.append(choice)
    body = {"id": rid, "object": "chat.completion", "created": created, "model": state.served_model_name,
            "choices": choices, "usage": usage(len(ids), sum(len(c.ids) for c in comps), cached)}
    body.update(_prompt_fields(req, ids, prompt_lps))
    return JSONResponse(body)


def _prompt_fields(req: ChatCompletionRequest, ids: list[int], prompt_lps: list | None) -> dict[str, Any]:
    """Top-level prompt fields (vLLM's places): `prompt_logprobs` and, with return_token_ids, the prompt ids."""
    out: dict[str, Any] = {}
    if req.prompt_logprobs is not None:
        out["prompt_logprobs"] = prompt_logprobs_json(prompt_lps)
    if req.return_token_ids:
        out["prompt_token_ids"] = ids
    return out


def _logprobs_block(state: ServerState, comp: _Completion, k: int | None) -> dict | None:
    content = _chat_logprobs(state, comp.ids, comp.logprobs, k)
    return None if content is None else {"content": content}


def _delta_body(state: ServerState, delta: Delta, comp: _Completion) -> dict[str, Any]:
    body: dict[str, Any] = {}
    if not comp.sent_role:
        comp.sent_role = True
        body["role"] = "assistant"
        body["content"] = ""
    if delta.reasoning is not None:
        body["reasoning"] = delta.reasoning
        if state.emit_reasoning_content:
            body["reasoning_content"] = delta.reasoning
    if delta.content is not None:
        body["content"] = delta.content
    if delta.tool_calls:
        comp.called = True
        body["tool_calls"] = [t.to_openai() for t in delta.tool_calls]
    return body


async def _stream(state: ServerState, req: ChatCompletionRequest, rid: str, created: int, prompt_ids: list[int],
                  stream, comps: list[_Completion], k: int | None) -> AsyncIterator[str]:
    include_usage, continuous = usage_flags(req)
    prompt_len = len(prompt_ids)
    cached = 0
    prompt_sent = False

    def chunk(choices: list[dict], prompt_lps: list | None) -> str:
        nonlocal prompt_sent
        body = {"id": rid, "object": "chat.completion.chunk", "created": created,
                "model": state.served_model_name, "choices": choices}
        if continuous:
            body["usage"] = usage(prompt_len, sum(len(c.ids) for c in comps), cached)
        elif include_usage:
            body["usage"] = None
        # The prompt fields ride on the first chunk that can carry them (prompt logprobs come after prefill).
        if not prompt_sent and (prompt_lps is not None or req.prompt_logprobs is None):
            prompt_sent = True
            body.update(_prompt_fields(req, prompt_ids, prompt_lps))
        return sse(body)

    try:
        async for _, d in merge([stream]):
            if d.finished:
                cached = d.num_cached_tokens
            choices = []
            for c in d.completions:
                comp = comps[c.index]
                delta = comp.advance(c)
                body = _delta_body(state, delta, comp)
                lps = _chat_logprobs(state, c.token_ids, c.logprobs, k)
                ids_out = req.return_token_ids and c.token_ids
                if not body and not c.finish_reason and not lps and not ids_out:
                    continue
                choice = {"index": c.index, "delta": body, "logprobs": None if lps is None else {"content": lps},
                          "finish_reason": _finish_reason(comp) if c.finish_reason else None}
                if c.finish_reason:
                    choice["stop_reason"] = comp.stop
                if req.return_token_ids:
                    choice["token_ids"] = c.token_ids
                choices.append(choice)
            if choices or d.prompt_logprobs is not None:
                yield chunk(choices, d.prompt_logprobs)
        if include_usage:
            u = usage(prompt_len, sum(len(c.ids) for c in comps), cached)
            yield sse({"id": rid, "object": "chat.completion.chunk", "created": created,
                       "model": state.served_model_name, "choices": [], "usage": u})
    except Exception as e:
        yield error_event(e)
    yield "data: [DONE]\n\n"


def _cat(a: str | None, b: str | None) -> str | None:
    return None if a is None and b is None else (a or "") + (b or "")


def _reject_images(messages: list) -> None:
    """hyserve serves no vision tower: an image would reach the model as a bare placeholder token, so say so
    instead of dropping it."""
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list) and any(
            isinstance(p, dict) and p.get("type") in ("image", "image_url", "input_image") for p in content
        ):
            raise APIError(400, f"messages[{i}] has an image part, but this server does not accept images",
                           param="messages")
