"""Rejection sampling of a verify step: which drafts the target accepts, and the token after them.

Target rows are laid out as the verify forward produces them: for each request, one row per draft
(the distribution of draft j given the drafts before it) and then one bonus row (after all drafts).

- Greedy requests accept while the draft equals the target's argmax and emit that argmax at the first
  mismatch (the correction); with every draft accepted they emit the bonus token.
- Sampled requests accept draft x with probability min(1, p(x)/q(x)) (p: processed target, q: the
  distribution the draft was drawn from; one-hot when the drafter drew greedily or has no model, as
  n-gram). Uniforms are float64 (a float32 draw can be exactly 0, pytorch#16706). At the first
  rejection they emit a token from the normalised positive residual max(0, p - q), so that position's
  token is distributed exactly as p.
- The bonus token (all drafts accepted) goes through the engine's Sampler on the bonus row, so every
  sampling setting applies as in a plain decode.
Seeded requests draw every random number from their own generator (only for rows they own), so their
tokens do not depend on the rest of the batch. Logprobs of emitted tokens are the target's raw
logprobs at their rows, as the sampler reports them for plain decodes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from hyserve.engine.phases import phase
from hyserve.engine.sampler import Sampler, _exponential_race, _logprob_stats
from hyserve.models.batch import to_device
from hyserve.spec_decode.target_probs import SpecRequest, process_logits, row_metadata, row_requests

REJECTED = -1  # padding of output_token_ids past a request's emitted tokens (vLLM's PLACEHOLDER_TOKEN_ID)


@dataclass
class RejectionOutput:
    # on the host, the three of them (the engine lands them token by token)
    output_token_ids: Tensor  # [B, K+1] long: accepted drafts, then the correction/bonus token; REJECTED after
    num_accepted: Tensor  # [B] long: drafts accepted (each request emits num_accepted + 1 tokens)
    emitted_rows: Tensor  # [E] long: the target row of each emitted token, requests in order
    logprobs: Tensor | None  # [E] raw target logprob of each emitted token; None when no request asks
    ranks: Tensor | None  # [E]
    top_token_ids: Tensor | None  # [E, k]
    top_logprobs: Tensor | None  # [E, k]

    def token_lists(self) -> list[list[int]]:
        counts = (self.num_accepted + 1).tolist()
        return [row[:n] for row, n in zip(self.output_token_ids.tolist(), counts)]


@dataclass
class _Layout:
    """Row bookkeeping of one verify step (host lists and their device tensors)."""

    num_drafts: list[int]
    starts: list[int]  # first target row of each request
    offsets: list[int]  # index of each request's first draft in the flattened drafts
    draft_rows: Tensor  # [N] target row of each draft
    draft_ids: Tensor  # [N]
    draft_req: Tensor  # [N] request of each draft
    draft_pos: Tensor  # [N] position of each draft within its request

    @classmethod
    def of(cls, requests: Sequence[SpecRequest], device: torch.device) -> _Layout:
        k = [len(r.draft_token_ids) for r in requests]
        starts, offsets = [0], [0]
        for n in k:
            starts.append(starts[-1] + n + 1)
            offsets.append(offsets[-1] + n)
        rows = [s + j for s, n in zip(starts, k) for j in range(n)]
        ids = [t for r in requests for t in r.draft_token_ids]
        req = [i for i, n in enumerate(k) for _ in range(n)]
        pos = [j for n in k for j in range(n)]

        def t(v: list[int]) -> Tensor:
            return torch.tensor(v, dtype=torch.long, device=device)

        return cls(k, starts[:-1], offsets[:-1], t(rows), t(ids), t(req), t(pos))


def draft_uniforms(requests: Sequence[SpecRequest], device: torch.device) -> Tensor:
    """One float64 U[0, 1) per draft: from the request's generator when it has one, else the global RNG."""
    parts = []
    for r in requests:
        n = len(r.draft_token_ids)
        if n:
            parts.append(torch.rand(n, dtype=torch.float64, device=device, generator=r.generator))
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.float64, device=device)


def _accepted_prefix(accept: Tensor, lay: _Layout, num_reqs: int) -> Tensor:
    """[B] number of leading accepted drafts of each request."""
    width = max(lay.num_drafts, default=0)
    grid = torch.zeros(num_reqs, width + 1, dtype=torch.long, device=accept.device)
    grid[lay.draft_req, lay.draft_pos] = accept.long()
    return grid.cumprod(dim=1).sum(dim=1)


def _acceptance(requests: Sequence[SpecRequest], proc, draft_probs: Tensor | None, lay: _Layout) -> Tensor:
    """[N] bool: does the target accept each draft, judged on its own (the prefix rule comes after)."""
    greedy = torch.tensor([requests[i].params.is_greedy for i in lay.draft_req.tolist()], device=lay.draft_ids.device)
    ids = lay.draft_ids.unsqueeze(1)
    accept = proc.greedy_logits[lay.draft_rows].argmax(dim=-1) == lay.draft_ids
    if proc.sample_logits is None or bool(greedy.all()):
        return accept
    p_x = proc.sample_logits[lay.draft_rows].softmax(dim=-1).gather(1, ids).squeeze(1).double()
    q_x = torch.ones_like(p_x) if draft_probs is None else draft_probs.gather(1, ids).squeeze(1).double()
    u = draft_uniforms(requests, lay.draft_ids.device)
    # p/q >= u without a division; p > 0 keeps a masked token out even on an exact u = 0
    sampled = (q_x > 0) & (p_x > 0) & (p_x >= u * q_x)
    return torch.where(greedy, accept, sampled)


def _recovered(requests, proc, draft_probs: Tensor | None, lay: _Layout, rows: Tensor, reqs: list[int],
               local: Tensor) -> Tensor:
    """The token at each first-rejected draft row: the argmax for greedy requests, else a draw from the
    normalised positive residual max(0, p - q) (p itself where the residual is empty)."""
    out = proc.greedy_logits[rows].argmax(dim=-1)
    sampled = [n for n, i in enumerate(reqs) if not requests[i].params.is_greedy]
    if not sampled:
        return out
    pick = torch.tensor(sampled, dtype=torch.long, device=rows.device)
    p = proc.sample_logits[rows[pick]].softmax(dim=-1)
    draft = lay.draft_ids[local[pick]]
    if draft_probs is None:
        residual = p.scatter(1, draft.unsqueeze(1), 0.0)
    else:
        residual = (p - draft_probs[local[pick]].float()).clamp_min_(0.0)
    empty = residual.sum(dim=-1, keepdim=True) <= 0
    residual = torch.where(empty, p, residual)
    gens = {n: requests[reqs[j]].generator for n, j in enumerate(sampled) if requests[reqs[j]].generator is not None}
    out[pick] = _exponential_race(residual, gens)
    return out


def synthetic_acceptance(requests: Sequence[SpecRequest], rates: Sequence[float], draft_pos: Sequence[int]) -> list[bool]:
    """[N] for a fixed acceptance curve (benchmarks only: the drafts are not judged at all). rates[j] is
    the probability that drafts 0..j are all accepted, so draft j passes with rates[j] / rates[j-1] given
    the ones before it. draft_pos [N]: each draft's position in its request. The uniforms are host draws
    (a seeded request's from its generator), so the curve costs a verify step no device work."""
    prev = [1.0] + list(rates[:-1])
    cond = [r / p if p > 0 else 0.0 for r, p in zip(rates, prev)] + [0.0]
    u = torch.rand(len(draft_pos), dtype=torch.float64).tolist()
    at = 0
    for r in requests:
        n, g = len(r.draft_token_ids), r.generator
        if n and g is not None:
            u[at : at + n] = torch.rand(n, dtype=torch.float64, device=g.device, generator=g).tolist()
        at += n
    return [x < cond[min(j, len(rates))] for x, j in zip(u, draft_pos)]


def _plain_greedy(requests: Sequence[SpecRequest], allowed_token_mask: Tensor | None) -> bool:
    """Every request greedy with nothing that changes its argmax (penalties, logit bias, min_tokens, a
    mask) and no logprobs: the raw logits decide the step, with no sampling metadata to build."""
    return allowed_token_mask is None and all(
        r.params.is_greedy and not r.params.has_penalties and not r.params.logit_bias and not r.params.min_tokens
        and r.params.logprobs is None for r in requests)


def _greedy_output(greedy_logits: Tensor, requests: Sequence[SpecRequest],
                   synthetic_rates: Sequence[float] | None) -> RejectionOutput:
    """Every request greedy and none asking for logprobs: each emitted token is the argmax of its processed
    row (a correction, a bonus, or after the curve's stop in synthetic mode), so one argmax over the rows
    and one read-back decide the step; the general path reads back three to five times and builds its
    bookkeeping on the device (about 2 ms of host time a step at batch 1 on an H200)."""
    ids = greedy_logits.argmax(dim=-1)
    with phase("readback"):
        best = ids.tolist()
    k = [len(r.draft_token_ids) for r in requests]
    passed = None if synthetic_rates is None else synthetic_acceptance(requests, synthetic_rates,
                                                                       [j for n in k for j in range(n)])
    width = max(k, default=0) + 1
    rows_out, accepted, emitted_rows, start, at = [], [], [], 0, 0
    for r, n in zip(requests, k):
        m = 0
        while m < n and (r.draft_token_ids[m] == best[start + m] if passed is None else passed[at + m]):
            m += 1
        tokens = list(r.draft_token_ids[:m]) + [best[start + m]]
        rows_out.append(tokens + [REJECTED] * (width - len(tokens)))
        accepted.append(m)
        emitted_rows.extend(range(start, start + m + 1))
        start, at = start + n + 1, at + n
    return RejectionOutput(torch.tensor(rows_out, dtype=torch.long).view(len(requests), width),
                           torch.tensor(accepted, dtype=torch.long), torch.tensor(emitted_rows, dtype=torch.long),
                           None, None, None, None)


def rejection_sample(
    target_logits: Tensor, requests: Sequence[SpecRequest], draft_probs: Tensor | None = None, *,
    eos_token_ids: Sequence[int] = (), allowed_token_mask: Tensor | None = None, vocab_size: int | None = None,
    synthetic_rates: Sequence[float] | None = None, sampler: Sampler | None = None,
) -> RejectionOutput:
    """target_logits [sum(k_i + 1), V] in the verify layout (not modified); draft_probs [sum(k_i), V],
    the distribution each draft was drawn from, or None for one-hot drafts (greedy drafters, n-gram);
    allowed_token_mask [sum(k_i + 1), V] (structured outputs, each row advanced through its draft
    prefix). synthetic_rates: accept by a fixed curve instead (rejection_sample_method 'synthetic')."""
    dev = target_logits.device
    rows = row_requests(requests)
    if target_logits.shape[0] != len(rows):
        raise ValueError(f"target_logits has {target_logits.shape[0]} rows; the drafts need {len(rows)}")
    if _plain_greedy(requests, allowed_token_mask):
        return _greedy_output(target_logits, requests, synthetic_rates)
    meta = row_metadata(requests, rows, dev, eos_token_ids, vocab_size)
    proc = process_logits(target_logits, meta, allowed_token_mask)
    if meta.all_greedy and proc.raw_logprobs is None:
        return _greedy_output(proc.greedy_logits, requests, synthetic_rates)
    lay = _Layout.of(requests, dev)
    if synthetic_rates is None:
        accept = _acceptance(requests, proc, draft_probs, lay)
    else:
        accept = to_device(synthetic_acceptance(requests, synthetic_rates, lay.draft_pos.tolist()), torch.bool, dev)
    accepted = _accepted_prefix(accept, lay, len(requests))
    m = accepted.tolist()
    final = _final_tokens(target_logits, requests, proc, draft_probs, lay, m, synthetic_rates is not None,
                          eos_token_ids, allowed_token_mask, vocab_size, sampler or Sampler())
    width = max(lay.num_drafts, default=0) + 1
    emitted_rows, emitted, rows_out = [], [], []
    drafts = lay.draft_ids.tolist()
    for i, (start, offset) in enumerate(zip(lay.starts, lay.offsets)):
        tokens = drafts[offset : offset + m[i]] + [final[i]]
        emitted_rows.extend(range(start, start + m[i] + 1))
        emitted.extend(tokens)
        rows_out.append(tokens + [REJECTED] * (width - len(tokens)))
    out = torch.tensor(rows_out, dtype=torch.long).view(len(requests), width)
    num_accepted, rows_t = torch.tensor(m, dtype=torch.long), torch.tensor(emitted_rows, dtype=torch.long)
    if proc.raw_logprobs is None:
        return RejectionOutput(out, num_accepted, rows_t, None, None, None, None)
    ids = to_device(emitted, torch.long, dev)
    stats = _logprob_stats(proc.raw_logprobs[to_device(emitted_rows, torch.long, dev)], ids, meta.max_num_logprobs)
    return RejectionOutput(out, num_accepted, rows_t, *stats)


def _final_tokens(target_logits, requests, proc, draft_probs, lay: _Layout, m: list[int], synthetic: bool,
                  eos_token_ids, allowed_token_mask, vocab_size, sampler: Sampler) -> list[int]:
    """The token after each request's accepted drafts: from the Sampler at the bonus row (every draft
    accepted; in synthetic mode at whichever row the curve stopped), else the recovered token."""
    dev = target_logits.device
    final = [0] * len(requests)
    by_sampler = [i for i, k in enumerate(lay.num_drafts) if synthetic or m[i] == k]
    if by_sampler:
        rows = torch.tensor([lay.starts[i] + m[i] for i in by_sampler], dtype=torch.long, device=dev)
        meta = row_metadata(requests, [(i, m[i]) for i in by_sampler], dev, eos_token_ids, vocab_size)
        mask = None if allowed_token_mask is None else allowed_token_mask[rows]
        tokens = sampler(target_logits[rows], meta, mask).token_ids.tolist()
        for i, t in zip(by_sampler, tokens):
            final[i] = t
    rejected = [i for i, k in enumerate(lay.num_drafts) if not synthetic and m[i] < k]
    if rejected:
        first_draft = [lay.offsets[i] + m[i] for i in rejected]
        local = torch.tensor(first_draft, dtype=torch.long, device=dev)
        tokens = _recovered(requests, proc, draft_probs, lay, lay.draft_rows[local], rejected, local).tolist()
        for i, t in zip(rejected, tokens):
            final[i] = t
    return final
