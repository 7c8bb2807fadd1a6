"""How many of a request's drafts a step verifies (docs/speculative_decoding.md, "Scheduler")."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hyserve.engine.request import Request


def verify_len(req: Request, budget: int, max_model_len: int) -> int:
    """Query tokens of a decode with drafts: 1 + the drafts that fit the step's token budget, the request's
    max_tokens (the last emitted token is the correction or bonus) and max_model_len (every verified
    position needs a place in the context, the bonus token's included)."""
    k = min(len(req.spec_token_ids), budget - 1, req.max_tokens - len(req.output_token_ids) - 1,
            max_model_len - req.num_tokens - 1)
    return 1 + max(k, 0)
