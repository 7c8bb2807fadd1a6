"""The target's distribution at every verified position, processed exactly as the sampler processes a
plain decode row (hyserve/engine/sampler.py): allowed-token mask -> logit bias and min-token masks ->
penalties -> temperature -> min-p -> top-k/top-p.

Row j of a request with drafts d_1..d_k is the position after d_1..d_j-1, so its penalties and
min_tokens count see the request's output tokens plus that draft prefix (vLLM appends the draft
prefix the same way). The functions applied are the sampler's own; only their sequencing is here,
because the sampler draws a token where verification needs the processed distribution.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from hyserve.engine.sampler import SamplingMetadata, greedy_logits, sampling_logits
from hyserve.sampling_params import SamplingParams


@dataclass
class SpecRequest:
    """One request of a verify step: what the sampler would know about it, plus its drafts."""

    params: SamplingParams
    output_token_ids: Sequence[int]  # generated before this step
    prompt_token_ids: Sequence[int]
    generator: torch.Generator | None
    draft_token_ids: Sequence[int]  # may be empty: the request only samples its next token


@dataclass
class ProcessedLogits:
    raw_logprobs: Tensor | None  # [R, V] log-softmax after the allowed mask only (vLLM's raw logprobs)
    greedy_logits: Tensor  # [R, V] after bias, masks and penalties: the argmax is the greedy token
    sample_logits: Tensor | None  # [R, V] further after temperature, min-p, top-k/top-p; None if all greedy


def row_requests(requests: Sequence[SpecRequest]) -> list[tuple[int, int]]:
    """(request, position) of each target row, in the verify layout: k_i draft rows then one bonus row."""
    return [(i, j) for i, r in enumerate(requests) for j in range(len(r.draft_token_ids) + 1)]


def row_metadata(
    requests: Sequence[SpecRequest], rows: Sequence[tuple[int, int]], device: torch.device | str,
    eos_token_ids: Sequence[int], vocab_size: int | None = None,
) -> SamplingMetadata:
    """SamplingMetadata with one row per (request, position): outputs extended by the draft prefix."""
    reqs = [requests[i] for i, _ in rows]
    if any(r.params.has_penalties or r.params.min_tokens for r in reqs):
        outputs = [list(r.output_token_ids) + list(r.draft_token_ids[:j]) for r, (_, j) in zip(reqs, rows)]
    else:  # nothing reads them: copying every row's history would cost O(rows x output length) per step
        outputs = [()] * len(reqs)
    return SamplingMetadata.build(
        [r.params for r in reqs], outputs, [r.prompt_token_ids for r in reqs], [r.generator for r in reqs],
        device, eos_token_ids, vocab_size,
    )


def process_logits(logits: Tensor, m: SamplingMetadata, allowed_token_mask: Tensor | None = None) -> ProcessedLogits:
    """logits [R, V] (not modified) through the sampler's processing, without drawing. All greedy: the
    greedy logits may be `logits` itself (nothing writes in place then; a copy per step was 3.3 MB at batch
    1 of a 163840-token vocabulary and 105 MB at 32)."""
    x, raw = greedy_logits(logits, m, allowed_token_mask, copy=not m.all_greedy)
    return ProcessedLogits(raw, x, None if m.all_greedy else sampling_logits(x, m))
