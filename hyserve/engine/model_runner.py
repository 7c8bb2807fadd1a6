"""Turns a scheduled step into one flattened forward and gathers only the logits that are used."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from hyserve.engine.cuda_graphs import DecodeGraphs
from hyserve.engine.kv_cache import KVCacheManager
from hyserve.engine.request import Request
from hyserve.engine.scheduler import ScheduledSeq, SchedulerOutput
from hyserve.models.batch import Batch, to_device
from hyserve.models.kimi import KimiForCausalLM


@dataclass
class StepLogits:
    sample_rows: list[int]  # indices into out.seqs of the sequences that sample a token
    logits: torch.Tensor  # [len(sample_rows), V] float32
    prompt_logits: dict[int, torch.Tensor]  # seq index -> [num_new_tokens, V] for prompt_logprobs


@dataclass
class PendingTokens:
    """The step before's sampled token ids, still on the device (async scheduling): row `rows[req]` of
    `token_ids` is the token at req's last position."""

    token_ids: torch.Tensor  # [N] long
    rows: dict[Request, int]


def _wants_prompt_logits(s: ScheduledSeq) -> bool:
    return s.req.params.prompt_logprobs is not None and s.start < s.req.num_prompt_tokens


class ModelRunner:
    def __init__(self, model: KimiForCausalLM, kv: KVCacheManager, graphs: DecodeGraphs | None = None):
        """`graphs`: decode steps that fit its ladder run through its static buffers (replayed CUDA
        graphs on the GPU); every other step runs eagerly."""
        self.model, self.kv, self.graphs = model, kv, graphs
        self.device = model.device

    def build_batch(
        self, out: SchedulerOutput, pending: PendingTokens | None = None
    ) -> tuple[torch.Tensor, Batch]:
        seqs = out.seqs
        ids: list[int] = []
        for s in seqs:
            known = s.req.all_token_ids[s.start : s.end]
            ids.extend(known + [0] * (s.num_new_tokens - len(known)))  # 0: a pending token's placeholder
        batch = Batch.build(
            query_lens=[s.num_new_tokens for s in seqs],
            context_lens=[s.end for s in seqs],
            block_tables=[s.req.block_ids for s in seqs],
            block_size=self.kv.block_size,
            state_slots=[s.req.state_slot for s in seqs],
            fresh_state=[s.fresh for s in seqs],
            device=self.device,
        )
        input_ids = to_device(ids, torch.long, self.device)
        src = _pending_sources(seqs, pending)
        if src is not None:
            rows = [i for i, j in enumerate(src) if j >= 0]
            ends = list(itertools.accumulate(s.num_new_tokens for s in seqs))
            at = to_device([ends[i] - 1 for i in rows], torch.long, self.device)
            tokens = pending.token_ids[to_device([src[i] for i in rows], torch.long, self.device)]
            input_ids.index_copy_(0, at, tokens)
        return input_ids, batch

    def uses_graph(self, out: SchedulerOutput) -> bool:
        """One new token per sequence, no prompt logprobs, and a batch the ladder covers."""
        if self.graphs is None or not out.seqs:
            return False
        if any(s.num_new_tokens != 1 or _wants_prompt_logits(s) for s in out.seqs):
            return False
        return self.graphs.size_for(len(out.seqs), max(len(s.req.block_ids) for s in out.seqs)) is not None

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, pending: PendingTokens | None = None) -> StepLogits:
        """`pending`: where the ids of tokens sampled by the step before but not yet read back are."""
        if self.uses_graph(out):
            return self._execute_graph(out, pending)
        input_ids, batch = self.build_batch(out, pending)
        hidden = self.model(input_ids, batch, self.kv.tensors)
        cu = [0, *itertools.accumulate(batch.query_lens)]  # host values: reading cu_seqlens back would sync
        sample_rows = [i for i, s in enumerate(out.seqs) if s.samples]
        last = to_device([cu[i + 1] - 1 for i in sample_rows], torch.long, self.device)
        logits = self.model.compute_logits(hidden[last])
        prompt_logits = {}
        for i, s in enumerate(out.seqs):
            if _wants_prompt_logits(s):
                end = min(s.end, s.req.num_prompt_tokens)
                prompt_logits[i] = self.model.compute_logits(hidden[cu[i] : cu[i] + end - s.start])
        return StepLogits(sample_rows, logits, prompt_logits)

    def _execute_graph(self, out: SchedulerOutput, pending: PendingTokens | None) -> StepLogits:
        seqs = out.seqs
        src = _pending_sources(seqs, pending)  # the graph gathers those ids from pending.token_ids itself
        logits = self.graphs.run(
            token_ids=[_token_at(s.req, s.start) for s in seqs],
            context_lens=[s.end for s in seqs],
            block_tables=[s.req.block_ids for s in seqs],
            state_slots=[s.req.state_slot for s in seqs],
            fresh_state=[s.fresh for s in seqs],
            prev_tokens=pending.token_ids if src is not None else None,
            token_src=src,
        )
        sample_rows = [i for i, s in enumerate(seqs) if s.samples]
        if len(sample_rows) < len(seqs):  # a one-token prefill chunk that does not reach the prompt's end
            logits = logits[to_device(sample_rows, torch.long, self.device)]
        return StepLogits(sample_rows, logits, {})


def _pending_sources(seqs: list[ScheduledSeq], pending: PendingTokens | None) -> list[int] | None:
    """For each sequence whose last new token is still pending, the index of its id in
    `pending.token_ids`, else -1; None when no sequence has one. Host values only."""
    src, any_pending = [], False
    for s in seqs:
        if s.end > s.req.num_known_tokens:
            if pending is None or s.req not in pending.rows or s.end != s.req.num_known_tokens + 1:
                raise RuntimeError(f"request {s.req.request_id}: a scheduled token's id is not known")
            src.append(pending.rows[s.req])
            any_pending = True
        else:
            src.append(-1)
    return src if any_pending else None


def _token_at(req: Request, i: int) -> int:
    # all_token_ids would concatenate the whole sequence for every row of every step
    n = req.num_prompt_tokens
    if i >= req.num_known_tokens:
        return 0  # a pending token's placeholder: its id is copied on the device
    return req.prompt_token_ids[i] if i < n else req.output_token_ids[i - n]
