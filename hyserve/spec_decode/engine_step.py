"""Speculative decoding inside the engine loop (docs/speculative_decoding.md §2): proposing n-gram drafts
after a step lands, rejection sampling of a step with verify rows, and landing its emitted tokens.

The engine owns one `SpecDecoder` when `speculative_config` is set and calls it at three points:
`verifies(out)` (does the step carry drafts: then it is sampled and landed here, synchronously),
`sample` (instead of the plain sampler) and `land` (instead of the plain landing); `propose` runs after
every landing. The cache manager moves the request's state column and computed count
(`KVCacheManager.land_verify`) before any stop check can finish the request, so whatever the prefix cache
keeps at that point (a finish retains pages and the state) covers accepted tokens only.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from hyserve.engine.phases import phased
from hyserve.engine.sampler import grammar_mask
from hyserve.spec_decode.config import SpeculativeConfig
from hyserve.spec_decode.ngram import NgramProposer, TokenHistory
from hyserve.spec_decode.reference_loop import SpecStats
from hyserve.spec_decode.rejection import RejectionOutput, rejection_sample
from hyserve.spec_decode.target_probs import SpecRequest

if TYPE_CHECKING:
    from hyserve.engine.llm_engine import LLMEngine
    from hyserve.engine.model_runner import ModelRunner, StepLogits
    from hyserve.engine.request import Request
    from hyserve.engine.scheduler import ScheduledSeq, SchedulerOutput
    from hyserve.engine.step_inputs import PendingTokens


def make_decoder(spec: SpeculativeConfig, max_model_len: int, model: torch.nn.Module, scheduler) -> SpecDecoder:
    """The decoder of the config's method (ValueError for a drafter that cannot run on this engine)."""
    if spec.method == "dspark":
        from hyserve.spec_decode.engine_dspark import DSparkDecoder

        return DSparkDecoder(spec, max_model_len, model, scheduler)
    return SpecDecoder(spec, max_model_len, scheduler)


class SpecDecoder:
    def __init__(self, spec: SpeculativeConfig, max_model_len: int, scheduler):
        self.config, self.scheduler = spec, scheduler
        if spec.method == "ngram":
            self.proposer = NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max,
                                          spec.num_speculative_tokens, max_model_len)
        self.synthetic = spec.synthetic_acceptance_rates if spec.rejection_sample_method == "synthetic" else None
        self.stats = SpecStats()  # the engine's cumulative counters (vLLM's spec_decode_* metrics)

    @staticmethod
    def verifies(out: SchedulerOutput) -> bool:
        """The step carries drafts: it is sampled by rejection and lands before anything plans on it."""
        return any(s.draft_ids for s in out.seqs)

    @phased("propose")
    def propose(self, reqs: Sequence[Request]) -> None:
        """New drafts for requests whose newest token just landed. Structured outputs do not speculate (their
        grammar would have to be advanced through every draft prefix); a request with a token still on the
        device has no complete history to match."""
        live = [r for r in reqs if not r.is_finished and r.matcher is None and not r.num_pending]
        for r in reqs:
            r.spec_token_ids = []
        if not self.scheduler.speculating():  # under load (disable_by_batch_size) nothing drafts
            return
        k = self.config.num_speculative_tokens
        known = (*self.scheduler.running, *self.scheduler.waiting)
        if len(self.proposer) > len(known):  # indexes of requests that finished or were aborted meanwhile
            self.proposer.retain(r.request_id for r in (*known, *live))
        histories = [TokenHistory(r.prompt_token_ids, r.output_token_ids) for r in live]
        for r, drafts in zip(live, self.proposer.propose(histories, [r.request_id for r in live])):
            if self.synthetic is not None:  # the curve judges no draft: every step verifies k (the AgentX runs')
                last = r.output_token_ids[-1] if r.output_token_ids else r.prompt_token_ids[-1]
                drafts = list(drafts) + [last] * (k - len(drafts))
            r.spec_token_ids = drafts

    def sample(self, seqs: Sequence[ScheduledSeq], logits: torch.Tensor, engine: LLMEngine) -> RejectionOutput:
        """Rejection sampling of the sampling sequences `seqs` (in the logits' order: 1 + drafts rows each)."""
        requests = [SpecRequest(s.req.params, s.req.output_token_ids, s.req.prompt_token_ids, s.req.generator,
                                s.draft_ids) for s in seqs]
        probs = self.draft_probs(seqs, logits.shape[1])
        return rejection_sample(logits, requests, probs, eos_token_ids=engine.eos_token_ids,
                                allowed_token_mask=_allowed_mask(seqs, logits), vocab_size=engine.model_config.vocab_size,
                                synthetic_rates=self.synthetic, sampler=engine.sampler)

    def draft_probs(self, seqs: Sequence[ScheduledSeq], vocab: int) -> torch.Tensor | None:
        """The distributions the step's drafts were drawn from; None: one-hot (n-gram)."""
        return None

    def execute(self, runner: ModelRunner, out: SchedulerOutput, pending: PendingTokens | None) -> StepLogits:
        """The step's forward (a drafter that reads the target's features taps it)."""
        return runner.execute(out, pending)

    def capture_graphs(self, max_batch: int) -> None:
        """The engine runs with CUDA graphs (or their static buffers): a drafter with a forward of its own
        builds its graphs here, after the target's. n-gram drafting has none."""

    def land(self, seqs: Sequence[ScheduledSeq], res: RejectionOutput, now: float, engine: LLMEngine) -> None:
        """Append each request's emitted tokens with stop checks token by token (a stop among them drops the
        rest), move its state column and computed count to the accepted drafts, then finish it if it stopped."""
        tokens, accepted = res.token_lists(), res.num_accepted.tolist()
        lps = _lists(res.logprobs, res.ranks, res.top_token_ids, res.top_logprobs)
        at = 0
        for s, emitted, a in zip(seqs, tokens, accepted):
            req, base = s.req, at
            req.num_pending -= 1
            at += len(emitted)
            if req.is_finished:
                continue
            self.stats.add(len(s.draft_ids), a)
            status, kept = None, a
            for j, tok in enumerate(emitted):
                status = engine.append_token(req, tok, now, *(None if v is None else v[base + j] for v in lps))
                if status is not None:
                    kept = min(j, a)  # the computed positions end with the stop token's
                    break
            if s.draft_ids:
                engine.kv.land_verify(req, s.start, kept)
            if status is not None:
                req.metrics.finished_time = time.time()
                engine.scheduler.finish(req, status)
        self.after_verify(seqs)

    def after_verify(self, seqs: Sequence[ScheduledSeq]) -> None:
        """The verify step landed: the next drafts."""
        self.propose([s.req for s in seqs])


def _lists(*tensors: torch.Tensor | None) -> list[list | None]:
    return [None if t is None else t.tolist() for t in tensors]


def _allowed_mask(seqs: Sequence[ScheduledSeq], logits: torch.Tensor) -> torch.Tensor | None:
    """Structured outputs in a verify step: their one row (they carry no drafts) masked by their grammar."""
    rows, at = [], 0
    for s in seqs:
        if s.req.matcher is not None:
            rows.append((at, s.req))
        at += 1 + len(s.draft_ids)
    return grammar_mask(rows, logits)
