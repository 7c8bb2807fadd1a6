"""One token budget per step, no prefill/decode phases (docs/ARCHITECTURE.md, "Scheduler").

Running requests are served first (a decode is one token; an unfinished prefill continues in chunks),
then waiting ones in FCFS or priority order. When pages run out, the latest arrival among the running
requests is preempted by recompute: it frees everything and goes back to the front of the queue.
Pages, slots and prefix hits come from the cache manager alone.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from hyserve.config import EngineConfig
from hyserve.engine.kv_cache import KVCacheManager
from hyserve.engine.phases import phased
from hyserve.engine.request import Request, RequestStatus
from hyserve.spec_decode.scheduling import verify_len

SeqKind = Literal["prefill", "decode", "verify"]


@dataclass
class ScheduledSeq:
    req: Request
    num_new_tokens: int
    start: int  # req.num_computed_tokens when scheduled
    fresh: bool = True  # the chunk starts from a zero KDA state (req.fresh_state when scheduled)
    # speculative decoding: the drafts this step verifies after the last token (num_new_tokens = 1 + drafts)
    draft_ids: Sequence[int] = ()

    @property
    def end(self) -> int:
        return self.start + self.num_new_tokens

    @property
    def kind(self) -> SeqKind:
        """What the step does for the sequence, from its progress and drafts, never from its query length
        (a one-token prompt tail is a prefill, vllm#55178)."""
        if self.draft_ids:
            return "verify"
        return "prefill" if self.start < self.req.num_prompt_tokens else "decode"

    @property
    def samples(self) -> bool:
        """The chunk reaches the last known token, so its last position yields the next token (a verify row's
        drafts come after it)."""
        return self.end - len(self.draft_ids) == self.req.num_tokens


@dataclass
class SchedulerOutput:
    seqs: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.seqs)


class Scheduler:
    def __init__(self, cfg: EngineConfig, kv: KVCacheManager):
        self.cfg, self.kv = cfg, kv
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.num_preemptions = 0

    # ---- queue management ------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def _next_waiting(self) -> Request:
        if self.cfg.scheduling_policy == "priority":
            return min(self.waiting, key=lambda r: (r.priority, r.arrival_time))
        return self.waiting[0]

    def finish(self, req: Request, status: RequestStatus) -> None:
        """Remove a request wherever it is and free its pages and slot."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = status
        # a failed step leaves the request's cache contents suspect: the prefix cache keeps none of them
        self.kv.free(req, cache=status is not RequestStatus.FINISHED_ERROR)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- the step --------------------------------------------------------------------------------
    def speculating(self) -> bool:
        """Whether requests draft for the next step: not while the running batch holds the speculative
        config's `disable_by_batch_size` requests (the proposers ask after each landing; a request admitted
        later joins the running batch of the step after)."""
        spec = self.cfg.speculative_config
        limit = spec.disable_by_batch_size if spec is not None else None
        return limit is None or len(self.running) < limit

    @phased("schedule")
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.cfg.max_num_batched_tokens
        cap = self.cfg.long_prefill_token_threshold or budget if len(self.running) + len(self.waiting) > 1 else budget
        for req in list(self.running):
            if budget == 0:
                break
            if req not in self.running:  # preempted earlier in this loop
                continue
            if len(req.output_token_ids) + req.num_pending >= req.max_tokens:
                continue  # async scheduling: its last token is still on the device; it ends when that lands
            n = min(req.num_tokens - req.num_computed_tokens, budget, cap)
            if req.spec_token_ids:  # a decode with drafts: its last token and up to k drafts
                n = verify_len(req, budget, self.cfg.max_model_len)
            while not (granted := self.kv.allocate_slots(req, n)):
                victim = self._victim()
                self._preempt(victim, out)
                budget = self.cfg.max_num_batched_tokens - out.num_tokens
                if victim is req:
                    break
            else:
                drafts = req.spec_token_ids[: granted - 1] if req.spec_token_ids else ()  # a chunk limit cuts them
                out.seqs.append(ScheduledSeq(req, granted, req.num_computed_tokens, req.fresh_state, drafts))
                budget -= granted
        if out.preempted:
            return out  # memory is short: admit nothing new this step
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_num_seqs:
            req = self._next_waiting()
            if req.num_pending:  # preempted with a token in flight: its prefill needs that token's id
                break
            hit = self.kv.get_computed_tokens(req)
            n = self.kv.allocate_slots(req, min(req.num_tokens - hit.num_tokens, budget, cap), hit)
            if not n:
                break
            self.waiting.remove(req)
            self.running.append(req)
            req.status = RequestStatus.RUNNING
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = time.time()
            out.seqs.append(ScheduledSeq(req, n, req.num_computed_tokens, req.fresh_state))
            budget -= n
        return out

    def _victim(self) -> Request:
        if self.cfg.scheduling_policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return max(self.running, key=lambda r: r.arrival_time)

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.running.remove(req)
        out.seqs = [s for s in out.seqs if s.req is not req]
        self.kv.free(req)
        req.spec_token_ids = []  # it prefills again; drafts come after its next sampled token
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.insert(0, req)
        out.preempted.append(req)
