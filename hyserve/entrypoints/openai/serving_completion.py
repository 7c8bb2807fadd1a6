"""POST /v1/completions: prompts as text or token ids, one engine request per prompt."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from hyserve.engine.structured import StructuredSpec
from hyserve.entrypoints.openai.protocol import APIError, CompletionRequest
from hyserve.entrypoints.openai.serving_common import (
    ServerState,
    build_params,
    collect,
    error_event,
    merge,
    new_id,
    resolve_max_tokens,
    sse,
    structured_constraint,
    submit,
    usage,
)

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


def _logprobs(state: ServerState, token_ids: list[int], entries: list[dict] | None, k: int | None,
              offset: int) -> dict[str, Any] | None:
    if k is None or entries is None:
        return None
    tokens, lps, tops, offsets = [], [], [], []
    for tid, entry in zip(token_ids, entries):
        text = state.tokenizer.decode([tid], skip_special_tokens=False)
        tokens.append(text)
        lps.append(entry[tid].logprob if tid in entry else None)
        ranked = sorted((lp for lp in entry.values() if lp.rank is not None and lp.rank <= k), key=lambda x: x.rank)
        tops.append({lp.decoded_token: lp.logprob for lp in ranked} if k > 0 else None)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


async def create_completion(state: ServerState, req: CompletionRequest, request: Request):
    state.check_model(req.model)
    if req.suffix:
        raise APIError(400, "suffix is not supported", param="suffix")
    prompts = normalize_prompts(state, req.prompt)
    constraint = structured_constraint(req)
    spec = None
    if constraint is not None:
        spec = StructuredSpec(constraint[0], constraint[1], end_token_ids=list(state.client.info["eos_token_ids"]))
    rid = new_id("cmpl")
    params = []
    for _, ids in prompts:
        max_tokens = resolve_max_tokens(state, len(ids), req.max_tokens, DEFAULT_MAX_TOKENS)
        params.append(build_params(req, max_tokens=max_tokens, logprobs=req.logprobs, stop_token_ids=[],
                                   structured=spec, skip_special_tokens=req.skip_special_tokens))
    streams = []
    try:
        for i, ((_, ids), p) in enumerate(zip(prompts, params)):
            streams.append(await submit(state, f"{rid}-{i}", ids, p, req))
    except BaseException:
        for s in streams:
            s.abort()
        raise
    created = int(time.time())
    echo = [(text if text is not None else state.tokenizer.decode(ids)) if req.echo else "" for text, ids in prompts]
    if req.stream:
        gen = _stream(state, req, rid, created, prompts, streams, echo)
        return StreamingResponse(gen, media_type="text/event-stream")
    results = await collect(streams, request)
    choices, n_out, cached = [], 0, 0
    for i, deltas in enumerate(results):
        per: dict[int, dict[str, Any]] = {}
        for d in deltas:
            cached += d.num_cached_tokens if d.finished else 0
            for c in d.completions:
                acc = per.setdefault(c.index, {"text": "", "ids": [], "lps": [], "finish": None, "stop": None})
                acc["text"] += c.text
                acc["ids"] += c.token_ids
                acc["lps"] += c.logprobs or []
                if c.finish_reason:
                    acc["finish"], acc["stop"] = c.finish_reason, c.stop_reason
        for j in range(req.n):
            acc = per.get(j, {"text": "", "ids": [], "lps": [], "finish": "abort", "stop": None})
            n_out += len(acc["ids"])
            choices.append({
                "index": i * req.n + j, "text": echo[i] + acc["text"],
                "logprobs": _logprobs(state, acc["ids"], acc["lps"], req.logprobs, len(echo[i])),
                "finish_reason": acc["finish"], "stop_reason": acc["stop"],
            })
    body = {"id": rid, "object": "text_completion", "created": created, "model": state.served_model_name,
            "choices": choices, "usage": usage(sum(len(ids) for _, ids in prompts), n_out, cached)}
    return JSONResponse(body)


async def _stream(state: ServerState, req: CompletionRequest, rid: str, created: int,
                  prompts: list, streams: list, echo: list[str]) -> AsyncIterator[str]:
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    n_out, cached, offsets = 0, 0, {}
    echoed: set[int] = set()

    def chunk(choices: list[dict]) -> str:
        body = {"id": rid, "object": "text_completion", "created": created, "model": state.served_model_name,
                "choices": choices}
        if include_usage:
            body["usage"] = None
        return sse(body)

    try:
        async for i, d in merge(streams):
            if d.finished:
                cached += d.num_cached_tokens
            choices = []
            for c in d.completions:
                index = i * req.n + c.index
                prefix = ""
                if index not in echoed:
                    echoed.add(index)
                    prefix = echo[i]
                n_out += len(c.token_ids)
                off = offsets.get(index, len(prefix))
                lps = _logprobs(state, c.token_ids, c.logprobs, req.logprobs, off)
                offsets[index] = off + len(c.text)
                choices.append({"index": index, "text": prefix + c.text, "logprobs": lps,
                                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
            if choices:
                yield chunk(choices)
        if include_usage:
            u = usage(sum(len(ids) for _, ids in prompts), n_out, cached)
            yield sse({"id": rid, "object": "text_completion", "created": created,
                       "model": state.served_model_name, "choices": [], "usage": u})
    except Exception as e:
        yield error_event(e)
    yield "data: [DONE]\n\n"
