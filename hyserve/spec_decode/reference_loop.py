"""Speculative generation of one sequence with no engine (the specification the engine integration is
checked against, and a way to measure acceptance offline).

Every step rescores the whole sequence plus its drafts from an empty state (`model.score`), so it is
quadratic and meant for tiny models and short outputs; what it fixes is the verify layout (1+k target
rows per step), the rejection sampler and the drafters' inputs, which the engine reuses unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from hyserve.sampling_params import SamplingParams
from hyserve.spec_decode.dspark_propose import DSparkProposer
from hyserve.spec_decode.ngram import NgramProposer
from hyserve.spec_decode.rejection import rejection_sample
from hyserve.spec_decode.target_features import tap_features
from hyserve.spec_decode.target_probs import SpecRequest

# drafts for a sequence (prompt + output so far): (draft ids, their draft distributions [k, V] or None)
Propose = Callable[[list[int], SamplingParams, "torch.Generator | None"], tuple[list[int], "torch.Tensor | None"]]


@dataclass
class SpecStats:
    """vLLM's spec-decode counters for one sequence."""

    num_drafts: int = 0  # verify steps that carried drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verify step, the bonus included (vLLM's 1 + accepted / drafts)."""
        return 1 + self.num_accepted_tokens / max(self.num_drafts, 1)

    def add(self, num_draft_tokens: int, accepted: int) -> None:
        if num_draft_tokens == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += accepted
        grow = num_draft_tokens - len(self.accepted_per_position)
        self.accepted_per_position += [0] * max(grow, 0)
        for j in range(accepted):
            self.accepted_per_position[j] += 1


def speculative_generate(model, prompt: list[int], max_tokens: int, params: SamplingParams, propose: Propose,
                         generator: torch.Generator | None = None, eos_token_ids: tuple[int, ...] = ()
                         ) -> tuple[list[int], SpecStats]:
    """Up to max_tokens tokens after `prompt` (stopping after an EOS id unless params.ignore_eos)."""
    out: list[int] = []
    stats = SpecStats()
    while len(out) < max_tokens:
        seq = prompt + out
        drafts, probs = propose(seq, params, generator)
        drafts = drafts[: max_tokens - len(out) - 1]  # never verify past the output budget
        probs = None if probs is None else probs[: len(drafts)]
        logits = model.score(seq + drafts)[len(seq) - 1 :]
        req = SpecRequest(params, out, prompt, generator, drafts)
        res = rejection_sample(logits, [req], probs, eos_token_ids=eos_token_ids)
        new = res.token_lists()[0]
        stats.add(len(drafts), int(res.num_accepted[0]))
        for t in new:
            out.append(t)
            if t in eos_token_ids and not params.ignore_eos:
                return out, stats
    return out[:max_tokens], stats


def ngram_propose(proposer: NgramProposer) -> Propose:
    def propose(seq, params, generator):
        return proposer.propose([seq])[0], None
    return propose


def dspark_propose(model, proposer: DSparkProposer, req_id: str = "ref") -> Propose:
    """Drafts from the DSpark drafter: the target features of every token before the anchor (recomputed
    each step here), then one block from the anchor, at the request's temperature."""
    layer_ids = proposer.drafter.config.target_layer_ids

    def propose(seq, params, generator):
        if len(seq) < 2:
            return [], None
        with tap_features(model, layer_ids) as tap:
            model.score(seq[:-1])
        feats = tap.features()
        proposer.truncate(req_id, 0)
        proposer.add_context(req_id, feats, torch.arange(feats.shape[0], device=feats.device))
        anchor = torch.tensor([seq[-1]], device=feats.device)
        temps = None if params.is_greedy else [params.temperature]
        block = proposer.propose([req_id], anchor, temps, [generator])
        probs = None if block.probs is None else block.probs[0]
        return block.token_ids[0].tolist(), probs
    return propose
