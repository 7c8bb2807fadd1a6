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
from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING

import torch

from hyserve.engine.phases import phased
from hyserve.engine.sampler import grammar_mask
from hyserve.planning.ceilings import H200, ceilings_for
from hyserve.planning.step_cost import StepCostModel
from hyserve.spec_decode.config import SpeculativeConfig
from hyserve.spec_decode.draft_budget import DraftBudget, step_seconds
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
    return SpecDecoder(spec, max_model_len, scheduler, _budget(spec, model))


def _budget(spec: SpeculativeConfig, model: torch.nn.Module) -> DraftBudget | None:
    """n-gram drafts' budget (draft_budget.py): none under a synthetic curve or a threshold of 0."""
    if spec.method != "ngram" or not spec.confidence_threshold:
        return None
    return DraftBudget(spec.confidence_threshold, step_seconds(*target_step_cost(model)), shadowed=True)


def target_step_cost(model: torch.nn.Module) -> tuple[Callable[[int], float], float]:
    """(the weight bytes a step of n tokens reads, the copy bandwidth): the target's steps costed at the
    device's ceilings (the H200's where none are known: the budget reads only their ratios)."""
    device = getattr(model, "device", torch.device("cpu"))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    cost = StepCostModel(model.config, weight_bytes=model.dtype.itemsize)
    return cost.weight_bytes, (ceilings_for(name) or H200).copy_bytes_per_s


class SpecDecoder:
    def __init__(self, spec: SpeculativeConfig, max_model_len: int, scheduler, budget: DraftBudget | None = None):
        self.config, self.scheduler, self.budget = spec, scheduler, budget
        if spec.method == "ngram":
            self.proposer = NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max,
                                          spec.num_speculative_tokens, max_model_len)
        self.synthetic = spec.synthetic_acceptance_rates if spec.rejection_sample_method == "synthetic" else None
        self.stats = SpecStats()  # the engine's cumulative counters (vLLM's spec_decode_* metrics)
        self._verified: set[Request] = set()  # the requests whose drafts the last verify step judged

    @staticmethod
    def verifies(out: SchedulerOutput) -> bool:
        """The step carries drafts: it is sampled by rejection and lands before anything plans on it."""
        return any(s.draft_ids for s in out.seqs)

    def may_draft(self, running: Sequence[Request]) -> bool:
        """Whether the next landing could give a running request drafts (the engine then waits for the step
        in flight before planning the next, so that the drafts come from every token): not when the budget
        says that even full drafts would not pay."""
        if self.budget is None:
            return True
        keys = [r.request_id for r in running if r.matcher is None]  # structured outputs never draft
        return self.budget.may_draft(keys, self.config.num_speculative_tokens, len(running))

    @phased("propose")
    def propose(self, reqs: Sequence[Request]) -> None:
        """New drafts for requests whose newest token just landed. Structured outputs do not speculate (their
        grammar would have to be advanced through every draft prefix); a request with a token still on the
        device has no complete history to match."""
        live = [r for r in reqs if not r.is_finished and r.matcher is None and not r.num_pending]
        for r in reqs:
            r.spec_token_ids = []
        self._landed_without_verify(reqs, self._judged(reqs))
        if not self.scheduler.speculating():  # under load (disable_by_batch_size) nothing drafts
            return
        k = self.config.num_speculative_tokens
        known = (*self.scheduler.running, *self.scheduler.waiting)
        if len(self.proposer) > len(known):  # indexes of requests that finished or were aborted meanwhile
            self.proposer.retain(r.request_id for r in (*known, *live))
        if self.budget is not None and len(self.budget) > len(known):  # and their acceptance records
            self.budget.retain(r.request_id for r in (*known, *live))
        histories = [TokenHistory(r.prompt_token_ids, r.output_token_ids) for r in live]
        proposals = self.proposer.propose(histories, [r.request_id for r in live])
        if self.budget is not None:
            keep = self.budget.lengths([r.request_id for r in live], [len(d) for d in proposals],
                                       len(self.scheduler.running))
            for r, h, d, n in zip(live, histories, proposals, keep):
                if d and not n:
                    self.budget.expect(r.request_id, len(h), d[0])
            self._expect_in_flight(reqs)
            proposals = [d[:n] for d, n in zip(proposals, keep)]
        for r, drafts in zip(live, proposals):
            if self.synthetic is not None:  # the curve judges no draft: every step verifies k (the AgentX runs')
                last = r.output_token_ids[-1] if r.output_token_ids else r.prompt_token_ids[-1]
                drafts = list(drafts) + [last] * (k - len(drafts))
            r.spec_token_ids = drafts

    def _judged(self, reqs: Sequence[Request]) -> set[Request]:
        """The requests whose turned-down draft the landed tokens just scored (draft_budget.py, shadow trials)."""
        if self.budget is None:
            return set()
        return {r for r in reqs if self.budget.judge(r.request_id, TokenHistory(r.prompt_token_ids, r.output_token_ids))}

    def _expect_in_flight(self, reqs: Sequence[Request]) -> None:
        """Requests with a step in flight (async scheduling: the engine did not wait, as no draft could pay)
        draft nothing; their first draft from the tokens known so far predicts the token in flight."""
        waiting = [r for r in reqs if not r.is_finished and r.matcher is None and r.num_pending]
        if not waiting:
            return
        histories = [TokenHistory(r.prompt_token_ids, r.output_token_ids) for r in waiting]
        for r, h, d in zip(waiting, histories, self.proposer.propose(histories, [r.request_id for r in waiting])):
            if d:
                self.budget.expect(r.request_id, len(h), d[0])

    def _landed_without_verify(self, reqs: Sequence[Request], judged: Collection[Request] = ()) -> None:
        """The budget's counts of the requests that verified nothing in the step that just landed, and had no
        shadow trial scored, decay."""
        if self.budget is not None:
            for r in reqs:
                if r not in self._verified and r not in judged:
                    self.budget.idle(r.request_id)
        self._verified.clear()

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
            if self.budget is not None and s.draft_ids:
                self.budget.record(req.request_id, len(s.draft_ids), a)
                self._verified.add(req)
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
