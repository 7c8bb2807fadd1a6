"""Batched sampling: one row of logits per sampled position in, one token per row out.

Processing order (docs/ARCHITECTURE.md, "Sampling"): allowed-token mask (structured outputs) ->
logit bias and min-token masks -> penalties -> temperature -> min-p -> top-k/top-p -> draw.

Logprobs follow vLLM's default ("raw logprobs"): they are the log-softmax of the model's logits after
only the structured-output mask, so they describe the model, not the sampling settings. Ranks are
1-based: 1 + the number of tokens with a strictly higher raw logprob.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from hyserve.models.batch import to_device
from hyserve.outputs import Logprob
from hyserve.sampling_params import SamplingParams, SamplingType

# Padding for ragged token lists; remapped to a scratch column V before any scatter.
_PAD = -1


def seeded_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """The per-request generator the engine keeps for a request with `seed`, for its whole life."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def grammar_mask(rows: Sequence[tuple[int, object]], logits: Tensor) -> Tensor | None:
    """The allowed-token mask of structured outputs: logits row j of each (j, request with a grammar matcher)
    takes its matcher's mask, every other row allows all; None when no row is constrained."""
    if not rows:
        return None
    mask = torch.ones_like(logits, dtype=torch.bool)
    for j, req in rows:
        mask[j] = req.matcher.allowed_mask(logits.shape[1]).to(mask.device)
    return mask


def _padded(rows: Sequence[Sequence[int]], device: torch.device | str) -> Tensor:
    width = max(1, max((len(r) for r in rows), default=0))
    data = [list(r) + [_PAD] * (width - len(r)) for r in rows]
    return to_device(data, torch.long, device)


def _scatter_index(token_ids: Tensor, vocab_size: int) -> Tensor:
    return torch.where(token_ids == _PAD, vocab_size, token_ids)


def _token_counts(token_ids: Tensor, vocab_size: int) -> Tensor:
    """[N, L] padded ids -> [N, V] float occurrence counts."""
    n = token_ids.shape[0]
    counts = torch.zeros(n, vocab_size + 1, dtype=torch.float32, device=token_ids.device)
    ones = torch.ones_like(token_ids, dtype=counts.dtype)
    counts.scatter_add_(1, _scatter_index(token_ids, vocab_size), ones)
    return counts[:, :vocab_size]


def _token_presence(token_ids: Tensor, vocab_size: int) -> Tensor:
    n = token_ids.shape[0]
    seen = torch.zeros(n, vocab_size + 1, dtype=torch.bool, device=token_ids.device)
    seen.scatter_(1, _scatter_index(token_ids, vocab_size), True)
    return seen[:, :vocab_size]


@dataclass
class SamplingMetadata:
    """Per-step batched sampling settings. Optional tensors are None when no row in the batch uses
    that feature, so the sampler skips the work entirely."""

    temperature: Tensor | None  # [N] float; 1.0 on greedy rows so dividing by it is harmless; None if all greedy
    is_greedy: Tensor | None  # [N] bool; None if all greedy (two host-to-device copies fewer a greedy step)
    all_greedy: bool
    top_k: Tensor | None  # [N] long, 0 = off
    max_top_k: int | None  # largest k when every non-greedy row has one (lets the sampler skip a sort)
    top_p: Tensor | None  # [N] float, 1.0 = off
    min_p: Tensor | None  # [N] float, 0.0 = off
    presence_penalty: Tensor | None  # [N]; the three penalties are None together
    frequency_penalty: Tensor | None
    repetition_penalty: Tensor | None
    output_token_ids: Tensor | None  # [N, L] long padded with -1; present with penalties
    prompt_token_ids: Tensor | None  # [N, P] long padded with -1; present with repetition penalty
    bias_rows: Tensor | None  # flat (row, token, value) triples of logit_bias
    bias_token_ids: Tensor | None
    bias_values: Tensor | None
    masked_rows: Tensor | None  # flat (row, token) pairs masked until min_tokens is reached
    masked_token_ids: Tensor | None
    generators: dict[int, torch.Generator]  # row -> its own generator (non-greedy rows only)
    max_num_logprobs: int | None  # largest `logprobs` in the batch; None when no row asks

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        output_token_ids: Sequence[Sequence[int]],
        prompt_token_ids: Sequence[Sequence[int]],
        generators: Sequence[torch.Generator | None],
        device: torch.device | str,
        eos_token_ids: Sequence[int],
        vocab_size: int | None = None,
    ) -> SamplingMetadata:
        """Build once per step. Row i is one sampled position: its request's params, the tokens it has
        generated before this position, its prompt, and its generator (required for a seeded request,
        and used for any non-greedy row that has one). EOS ids are masked by `min_tokens` unless the
        request ignores EOS. With `vocab_size`, out-of-range logit_bias ids raise ValueError."""
        n = len(params)
        if not (len(output_token_ids) == len(prompt_token_ids) == len(generators) == n):
            raise ValueError("params, output_token_ids, prompt_token_ids and generators must align")
        greedy = [p.is_greedy for p in params]
        all_greedy = all(greedy)
        penalised = any(p.has_penalties for p in params)
        repetition = any(p.repetition_penalty != 1.0 for p in params)
        bias, masked = _bias_and_min_tokens(params, output_token_ids, eos_token_ids, vocab_size)

        def floats(values: list) -> Tensor:
            return to_device(values, torch.float32, device)

        def tensor_if(values: list, off, dtype: torch.dtype) -> Tensor | None:
            return None if all(v == off for v in values) else to_device(values, dtype, device)

        def long_or_none(values: list[int]) -> Tensor | None:
            return to_device(values, torch.long, device) if values else None

        sampled_k = [p.top_k for p, g in zip(params, greedy) if not g]
        logprob_counts = [p.logprobs for p in params if p.logprobs is not None]
        return cls(
            temperature=None if all_greedy else floats([1.0 if g else p.temperature for p, g in zip(params, greedy)]),
            is_greedy=None if all_greedy else to_device(greedy, torch.bool, device),
            all_greedy=all_greedy,
            top_k=tensor_if([p.top_k for p in params], 0, torch.long),
            max_top_k=max(sampled_k) if sampled_k and all(sampled_k) else None,
            top_p=tensor_if([p.top_p for p in params], 1.0, torch.float32),
            min_p=tensor_if([p.min_p for p in params], 0.0, torch.float32),
            presence_penalty=floats([p.presence_penalty for p in params]) if penalised else None,
            frequency_penalty=floats([p.frequency_penalty for p in params]) if penalised else None,
            repetition_penalty=floats([p.repetition_penalty for p in params]) if penalised else None,
            output_token_ids=_padded(output_token_ids, device) if penalised else None,
            prompt_token_ids=_padded(prompt_token_ids, device) if repetition else None,
            bias_rows=long_or_none(bias[0]),
            bias_token_ids=long_or_none(bias[1]),
            bias_values=floats(bias[2]) if bias[2] else None,
            masked_rows=long_or_none(masked[0]),
            masked_token_ids=long_or_none(masked[1]),
            generators=_row_generators(params, generators, greedy),
            max_num_logprobs=max(logprob_counts) if logprob_counts else None,
        )


def _bias_and_min_tokens(params, output_token_ids, eos_token_ids, vocab_size):
    """((rows, token ids, values) of logit_bias, (rows, token ids) masked until min_tokens is reached)."""
    bias: tuple[list, list, list] = ([], [], [])
    masked: tuple[list, list] = ([], [])
    for i, p in enumerate(params):
        for token, value in (p.logit_bias or {}).items():
            if vocab_size is not None and token >= vocab_size:
                raise ValueError(f"logit_bias token id {token} is out of range (vocab size {vocab_size})")
            bias[0].append(i)
            bias[1].append(token)
            bias[2].append(value)
        if len(output_token_ids[i]) < p.min_tokens:
            stops = set(p.stop_token_ids or ())
            if not p.ignore_eos:
                stops.update(eos_token_ids)
            masked[0].extend([i] * len(stops))
            masked[1].extend(sorted(stops))
    return bias, masked


def _row_generators(params, generators, greedy) -> dict[int, torch.Generator]:
    rows: dict[int, torch.Generator] = {}
    for i, (p, g) in enumerate(zip(params, generators)):
        if p.sampling_type == SamplingType.RANDOM_SEED and g is None:
            raise ValueError(f"row {i} has seed={p.seed} but no generator")
        if g is not None and not greedy[i]:
            rows[i] = g
    return rows


@dataclass
class SamplerOutput:
    token_ids: Tensor  # [N] long
    logprobs: Tensor | None  # [N] float: raw logprob of each sampled token; None when no row asks for logprobs
    ranks: Tensor | None  # [N] long: 1-based rank of each sampled token in the raw distribution; None likewise
    top_token_ids: Tensor | None  # [N, k], k = max requested logprobs; None when k is 0 or unasked
    top_logprobs: Tensor | None  # [N, k]


@dataclass
class PromptLogprobsOutput:
    """Row t describes prompt token t+1 given tokens 0..t (token 0 has no logprob)."""

    token_logprobs: Tensor  # [T]
    ranks: Tensor  # [T]
    top_token_ids: Tensor | None  # [T, k]
    top_logprobs: Tensor | None  # [T, k]


def _logprob_stats(
    logprobs: Tensor, token_ids: Tensor, k: int | None
) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    if not k:
        return chosen.squeeze(1), ranks, None, None
    top_logprobs, top_ids = logprobs.topk(k, dim=-1)
    return chosen.squeeze(1), ranks, top_ids, top_logprobs


def apply_penalties(
    logits: Tensor,
    output_token_ids: Tensor,
    prompt_token_ids: Tensor | None,
    presence: Tensor,
    frequency: Tensor,
    repetition: Tensor,
) -> Tensor:
    """Repetition (prompt + output tokens) first, then presence/frequency (output tokens only)."""
    vocab_size = logits.shape[-1]
    counts = _token_counts(output_token_ids, vocab_size)
    if prompt_token_ids is not None:
        seen = (counts > 0) | _token_presence(prompt_token_ids, vocab_size)
        r = repetition.unsqueeze(1)
        logits = torch.where(seen, torch.where(logits > 0, logits / r, logits * r), logits)
    return logits - frequency.unsqueeze(1) * counts - presence.unsqueeze(1) * (counts > 0)


def apply_min_p(logits: Tensor, min_p: Tensor) -> Tensor:
    """Drop tokens whose probability is below min_p times the most likely token's."""
    probs = logits.softmax(dim=-1)
    threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(
    logits: Tensor, top_k: Tensor | None, top_p: Tensor | None, max_top_k: int | None = None
) -> Tensor:
    """Keep each row's k best tokens, then the smallest prefix of them holding top_p of the mass.

    With `max_top_k` (every row has a k, none above it) only that many candidates are ranked, via
    topk; otherwise one stable full sort, so among equal logits the lower id comes first."""
    vocab_size = logits.shape[-1]
    if max_top_k is not None and max_top_k < vocab_size:
        # A full sort of a 160k vocabulary dominates the sampler's time; topk of a few dozen does not.
        sorted_logits, order = logits.topk(max_top_k, dim=-1)
    else:
        sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
    position = torch.arange(sorted_logits.shape[-1], device=logits.device)
    if top_k is not None:
        k = torch.where(top_k > 0, top_k, vocab_size)
        sorted_logits = sorted_logits.masked_fill(position >= k.unsqueeze(1), float("-inf"))
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        # top_p == 1 must keep everything, even where float cumsum reaches 1 early.
        limit = torch.where(top_p >= 1.0, float("inf"), top_p)
        sorted_logits = sorted_logits.masked_fill(mass_before >= limit.unsqueeze(1), float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter_(-1, order, sorted_logits)


def _exponential_race(probs: Tensor, generators: dict[int, torch.Generator]) -> Tensor:
    """argmax(p / E) with E ~ Exp(1) picks token i with probability p_i. Seeded rows draw E from their
    own generator, so their tokens do not depend on what else is in the batch."""
    noise = torch.empty_like(probs)
    if len(generators) < probs.shape[0]:
        noise.exponential_()
    for row, generator in generators.items():
        noise[row].exponential_(generator=generator)
    # An exact 0 draw would give 0/0 = NaN on masked tokens, and argmax prefers NaN.
    noise.clamp_min_(torch.finfo(noise.dtype).tiny)
    return (probs / noise).argmax(dim=-1)


def greedy_logits(
    logits: Tensor, m: SamplingMetadata, allowed_token_mask: Tensor | None, copy: bool
) -> tuple[Tensor, Tensor | None]:
    """(fp32 logits after the allowed-token mask, logit bias, min-token masks and penalties: their argmax
    is the greedy token; the raw log-probs, after the mask alone, or None when no row asks for them).
    `copy`: never write into `logits` (otherwise a copy is made only where a step below writes in place)."""
    in_place = allowed_token_mask is not None or m.bias_rows is not None or m.masked_rows is not None
    x = logits.to(torch.float32, copy=copy or in_place)
    if allowed_token_mask is not None:
        x.masked_fill_(~allowed_token_mask, float("-inf"))
    # no row asks for logprobs: skip the log-softmax over the vocabulary (36 µs of a 2.9 ms batch-1 step
    # of the 48B model on an H200) and the rank count
    raw = x.log_softmax(dim=-1) if m.max_num_logprobs is not None else None
    if m.bias_rows is not None:
        x.index_put_((m.bias_rows, m.bias_token_ids), m.bias_values, accumulate=True)
    if m.masked_rows is not None:
        x[m.masked_rows, m.masked_token_ids] = float("-inf")
    if m.output_token_ids is not None:
        x = apply_penalties(x, m.output_token_ids, m.prompt_token_ids, m.presence_penalty,
                            m.frequency_penalty, m.repetition_penalty)
    return x, raw


def sampling_logits(x: Tensor, m: SamplingMetadata) -> Tensor:
    """greedy_logits' result through temperature, min-p and top-k/top-p: what a sampled row draws from."""
    x = x / m.temperature.unsqueeze(1)
    if m.min_p is not None:
        x = apply_min_p(x, m.min_p)
    if m.top_k is not None or m.top_p is not None:
        x = apply_top_k_top_p(x, m.top_k, m.top_p, m.max_top_k)
    return x


class Sampler(nn.Module):
    @torch.no_grad()
    def forward(
        self, logits: Tensor, metadata: SamplingMetadata, allowed_token_mask: Tensor | None = None
    ) -> SamplerOutput:
        """logits: [N, V] (not modified). allowed_token_mask: [N, V] bool, False = forbidden."""
        m = metadata
        logits, raw_logprobs = greedy_logits(logits, m, allowed_token_mask, copy=False)
        # Truncation always keeps the most likely token, so the argmax here is the greedy choice.
        token_ids = logits.argmax(dim=-1)
        if not m.all_greedy:
            sampled = _exponential_race(sampling_logits(logits, m).softmax(dim=-1), m.generators)
            token_ids = torch.where(m.is_greedy, token_ids, sampled)

        if raw_logprobs is None:
            return SamplerOutput(token_ids, None, None, None, None)
        chosen, ranks, top_ids, top_logprobs = _logprob_stats(raw_logprobs, token_ids, m.max_num_logprobs)
        return SamplerOutput(token_ids, chosen, ranks, top_ids, top_logprobs)


@torch.no_grad()
def compute_prompt_logprobs(logits: Tensor, next_token_ids: Tensor, k: int) -> PromptLogprobsOutput:
    """logits[t] is the model's prediction after prompt token t; next_token_ids[t] is prompt token t+1.

    The caller prepends None for prompt token 0, which has no context (as vLLM does)."""
    logprobs = logits.float().log_softmax(dim=-1)
    chosen, ranks, top_ids, top_logprobs = _logprob_stats(logprobs, next_token_ids.long(), k)
    return PromptLogprobsOutput(chosen, ranks, top_ids, top_logprobs)


def logprob_dicts(
    token_ids: Sequence[int],
    logprobs: Sequence[float],
    ranks: Sequence[int],
    top_token_ids: Sequence[Sequence[int]] | None,
    top_logprobs: Sequence[Sequence[float]] | None,
    num_logprobs: Sequence[int],
) -> list[dict[int, Logprob]]:
    """Per-row {token id: Logprob} for the output: the chosen token first, then the row's own top-k.

    Takes host lists (call .tolist() once per step); decoded_token is left for the detokenizer."""
    rows = []
    for i, (token, logprob, rank) in enumerate(zip(token_ids, logprobs, ranks)):
        entry = {token: Logprob(logprob, rank)}
        for j in range(num_logprobs[i]):
            top = top_token_ids[i][j]
            if top not in entry:
                entry[top] = Logprob(top_logprobs[i][j], j + 1)
        rows.append(entry)
    return rows
