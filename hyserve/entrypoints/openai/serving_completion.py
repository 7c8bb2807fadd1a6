"""POST /v1/completions: prompts as text or token ids, one engine request per prompt."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from hyserve.entrypoints.openai.protocol import APIError, CompletionRequest
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
from hyserve.structured.constraint import StructuredSpec

DEFAULT_MAX_TOKENS = 16  # the OpenAI completions default


def normalize_prompts(state: ServerState, prompt: Any) -> list[tuple[str | None, list[int]]]:
    """(text, ids) per prompt: a string, a list of strings, token ids, or a list of token-id lists."""
    if isinstance(prompt, str):
        prompts: list = [prompt]
    elif prompt and all(isinstance(t, int) for t in prompt):
        prompts = [prompt]
    else:
        prompts = list(prompt)
    if not prompts:
        raise APIError(400, "prompt must not be empty", param="prompt")
    vocab = int(state.client.info["vocab_size"])
    out = []
    for p in prompts:
        ids = state.tokenizer.encode(p) if isinstance(p, str) else list(p)
        if not ids:
            raise APIError(400, "prompt must not be empty", param="prompt")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"prompt token ids out of range [0, {vocab}): {bad[:5]}", param="prompt")
        out.append((p if isinstance(p, str) else None, ids))
    return out


def _logprobs(state: ServerState, token_ids: list[int], entries: list[dict | None] | None, k: int | None,
              offset: int) -> dict[str, Any] | None:
    """The completions logprobs block; a None entry (the first prompt token, when echoed) has no logprob."""
    if k is None or entries is None:
        return None
    tokens, lps, tops, offsets = [], [], [], []
    for tid, entry in zip(token_ids, entries):
        text = state.tokenizer.decode([tid], skip_special_tokens=False)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if entry is None:
            lps.append(None)
            tops.append(None)
            continue
        lps.append(entry[tid].logprob if tid in entry else None)
        ranked = sorted((lp for lp in entry.values() if lp.rank is not None and lp.rank <= k), key=lambda x: x.rank)
        tops.append({lp.decoded_token: lp.logprob for lp in ranked} if k > 0 else None)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def _joined(a: dict[str, Any] | None, b: dict[str, Any] | None) -> dict[str, Any] | None:
    if a is None or b is None:
        return b if a is None else a
    return {key: a[key] + b[key] for key in a}


class _Prompt:
    """One prompt of the request: its ids, the echoed text, and its prompt logprobs once they arrive."""

    def __init__(self, text: str, ids: list[int]) -> None:
        self.text, self.ids = text, ids
        self.logprobs: list | None = None


def _first_fields(state: ServerState, req: CompletionRequest, p: _Prompt) -> tuple[str, dict[str, Any] | None,
                                                                                  dict[str, Any]]:
    """What a choice's first output carries besides its tokens: echo text, the echoed prompt's logprobs,
    and the per-choice prompt fields."""
    echo_lps = _logprobs(state, p.ids, p.logprobs, req.logprobs, 0) if req.echo and p.logprobs else None
    extra: dict[str, Any] = {}
    if req.prompt_logprobs is not None:
        extra["prompt_logprobs"] = prompt_logprobs_json(p.logprobs)
    if req.return_token_ids:
        extra["prompt_token_ids"] = p.ids
    return p.text if req.echo else "", echo_lps, extra


async def create_completion(state: ServerState, req: CompletionRequest, request: Request):
    state.check_model(req.model)
    check_request(state, req)
    if req.suffix:
        raise APIError(400, "suffix is not supported", param="suffix")
    if req.spaces_between_special_tokens and not req.skip_special_tokens:
        # The detokenizer joins special tokens without spaces; claiming otherwise would lose the request.
        raise APIError(400, "spaces_between_special_tokens=true is not supported: special tokens are decoded "
                       "without spaces between them", param="spaces_between_special_tokens")
    prompts = []
    for text, ids in normalize_prompts(state, req.prompt):
        kept = truncate_prompt(state, req, ids)
        # Echo shows what the model saw: the decoded ids when the prompt was given as ids or truncated.
        prompts.append(_Prompt(text if text is not None and len(kept) == len(ids) else state.tokenizer.decode(kept), kept))
    constraint = structured_constraint(req)
    spec = None
    if constraint is not None:
        spec = StructuredSpec(constraint[0], constraint[1], end_token_ids=list(state.client.info["eos_token_ids"]))
    # Echo with logprobs leads the block with the prompt's own logprobs, so the engine computes them too.
    prompt_k = req.prompt_logprobs
    if req.echo and req.logprobs is not None:
        prompt_k = max(prompt_k or 0, req.logprobs)
    rid = new_id("cmpl")
    params = []
    for p in prompts:
        max_tokens = resolve_max_tokens(state, len(p.ids), req.max_tokens, DEFAULT_MAX_TOKENS)
        params.append(build_params(req, max_tokens=max_tokens, logprobs=req.logprobs, stop_token_ids=[],
                                   structured=spec, skip_special_tokens=req.skip_special_tokens,
                                   prompt_logprobs=prompt_k))
    streams = []
    try:
        for i, (p, sp) in enumerate(zip(prompts, params)):
            streams.append(await submit(state, f"{rid}-{i}", p.ids, sp, req))
    except BaseException:
        for s in streams:
            s.abort()
        raise
    created = int(time.time())
    if req.stream:
        gen = _stream(state, req, rid, created, prompts, streams)
        return StreamingResponse(gen, media_type="text/event-stream")
    results = await collect(streams, request)
    choices, n_out, cached = [], 0, 0
    for i, deltas in enumerate(results):
        per: dict[int, dict[str, Any]] = {}
        for d in deltas:
            cached += d.num_cached_tokens if d.finished else 0
            if d.prompt_logprobs is not None:
                prompts[i].logprobs = d.prompt_logprobs
            for c in d.completions:
                acc = per.setdefault(c.index, {"text": "", "ids": [], "lps": [], "finish": None, "stop": None})
                acc["text"] += c.text
                acc["ids"] += c.token_ids
                acc["lps"] += c.logprobs or []
                if c.finish_reason:
                    acc["finish"], acc["stop"] = c.finish_reason, c.stop_reason
        echo, echo_lps, extra = _first_fields(state, req, prompts[i])
        for j in range(req.n):
            acc = per.get(j, {"text": "", "ids": [], "lps": [], "finish": "abort", "stop": None})
            n_out += len(acc["ids"])
            lps = _logprobs(state, acc["ids"], acc["lps"], req.logprobs, len(echo))
            choice = {"index": i * req.n + j, "text": echo + acc["text"], "logprobs": _joined(echo_lps, lps),
                      "finish_reason": acc["finish"], "stop_reason": acc["stop"], **extra}
            if req.return_token_ids:
                choice["token_ids"] = acc["ids"]
            choices.append(choice)
    body = {"id": rid, "object": "text_completion", "created": created, "model": state.served_model_name,
            "choices": choices, "usage": usage(sum(len(p.ids) for p in prompts), n_out, cached)}
    return JSONResponse(body)


async def _stream(state: ServerState, req: CompletionRequest, rid: str, created: int,
                  prompts: list[_Prompt], streams: list) -> AsyncIterator[str]:
    include_usage, continuous = usage_flags(req)
    prompt_tokens = sum(len(p.ids) for p in prompts)
    n_out, cached, offsets = 0, 0, {}
    started: set[int] = set()

    def chunk(choices: list[dict]) -> str:
        body = {"id": rid, "object": "text_completion", "created": created, "model": state.served_model_name,
                "choices": choices}
        if continuous:
            body["usage"] = usage(prompt_tokens, n_out, cached)
        elif include_usage:
            body["usage"] = None
        return sse(body)

    try:
        async for i, d in merge(streams):
            if d.finished:
                cached += d.num_cached_tokens
            if d.prompt_logprobs is not None:
                prompts[i].logprobs = d.prompt_logprobs
            choices = []
            for c in d.completions:
                index = i * req.n + c.index
                prefix, prefix_lps, extra = "", None, {}
                if index not in started:
                    started.add(index)
                    prefix, prefix_lps, extra = _first_fields(state, req, prompts[i])
                n_out += len(c.token_ids)
                off = offsets.get(index, len(prefix))
                lps = _joined(prefix_lps, _logprobs(state, c.token_ids, c.logprobs, req.logprobs, off))
                offsets[index] = off + len(c.text)
                choice = {"index": index, "text": prefix + c.text, "logprobs": lps,
                          "finish_reason": c.finish_reason, "stop_reason": c.stop_reason, **extra}
                if req.return_token_ids:
                    choice["token_ids"] = c.token_ids
                choices.append(choice)
            if choices:
                yield chunk(choices)
        if include_usage:
            u = usage(prompt_tokens, n_out, cached)
            yield sse({"id": rid, "object": "text_completion", "created": created,
                       "model": state.served_model_name, "choices": [], "usage": u})
    except Exception as e:
        yield error_event(e)
    yield "data: [DONE]\n\n"
