"""Shared helpers for the prefix-cache tests: run-to-completion helpers and a closed-loop multi-turn agent
workload whose prompts depend on earlier outputs (engines come from conftest's `make_engine`)."""

from __future__ import annotations

import itertools
import random

from hyserve import SamplingParams
from hyserve.engine.llm_engine import LLMEngine
from hyserve.outputs import RequestOutput

GREEDY = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
_ids = itertools.count()


def generate(engine: LLMEngine, prompt: list[int], params: SamplingParams = GREEDY, salt: str | None = None) -> RequestOutput:
    rid = f"r{next(_ids)}"
    engine.add_request(rid, {"prompt_token_ids": prompt}, params, cache_salt=salt)
    while True:
        for out in engine.step():
            if out.request_id == rid and out.finished:
                return out


def batch(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[RequestOutput]:
    rids = [f"r{next(_ids)}" for _ in prompts]
    for rid, p in zip(rids, prompts):
        engine.add_request(rid, {"prompt_token_ids": p}, params)
    done: dict[str, RequestOutput] = {}
    while len(done) < len(rids):
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [done[r] for r in rids]


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, 250) for _ in range(n)]


def agent_workload(engine: LLMEngine, sessions: int = 25, turns: int = 8, seed: int = 0) -> list[RequestOutput]:
    """Agent sessions run in waves (one request per live session per wave): two shared system prompts,
    a user task, then turns of (previous prompt + output + tool result); every third session forks
    from a random earlier turn of an earlier session (branching). Returns outputs in request order."""
    rng = random.Random(seed)
    systems = [tokens(rng, 37), tokens(rng, 29)]
    ctx = [systems[i % 2] + tokens(rng, rng.randrange(5, 20)) for i in range(sessions)]
    history: list[list[int]] = []
    outs: list[RequestOutput] = []
    for _ in range(turns):
        wave = batch(engine, ctx)
        outs.extend(wave)
        for i, o in enumerate(wave):
            history.append(ctx[i] + o.outputs[0].token_ids)
            if i % 3 == 2 and rng.random() < 0.5:  # branch: resume an earlier context, new tool result
                ctx[i] = rng.choice(history) + tokens(rng, rng.randrange(3, 12))
            else:
                ctx[i] = history[-1] + tokens(rng, rng.randrange(3, 20))
            if len(ctx[i]) > 200:  # compaction: keep the system prompt, restart the conversation
                ctx[i] = systems[i % 2] + tokens(rng, rng.randrange(5, 20))
    return outs
