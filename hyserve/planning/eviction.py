"""Which prefix-cache checkpoint goes when a slot is needed (engine/checkpoints.py keeps the state).

Never a running request's resume point: the newest checkpoint on its chain, what it restarts from if it is
preempted (the store leaves those out of the candidates). Then superseded checkpoints first, those of a
session that went on without them:
  - when a request resumes from a checkpoint that covers its owner's prompt (at or past the prompt's last
    full page: a continuation of the owner's session, not a new session sharing a shorter prefix), the
    owner's deeper checkpoints are branches the session skipped;
  - a checkpoint one request resumed from, once that request has taken a newer one.
A second resume makes a checkpoint a branch point (subagents, retries, a shared system prompt): never
superseded. So a session's older checkpoints go before another live session's newest one. Among the
candidates of the same kind, the lowest Marconi score goes: recency plus prefill FLOPs saved per byte held,
each min-max normalized over the candidates, the second weighted by `alpha`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class Candidate(Protocol):
    flops_saved: float
    nbytes: int
    last_use: int
    superseded: bool


def eviction_victim(cands: Sequence[Candidate], alpha: float = 1.0) -> Candidate:
    eff = [c.flops_saved / c.nbytes for c in cands]
    rec = [c.last_use for c in cands]
    e_lo, e_span = min(eff), (max(eff) - min(eff)) or 1.0
    r_lo, r_span = min(rec), (max(rec) - min(rec)) or 1.0

    def rank(c: Candidate) -> tuple[bool, float]:
        return not c.superseded, alpha * (c.flops_saved / c.nbytes - e_lo) / e_span + (c.last_use - r_lo) / r_span

    return min(cands, key=rank)
