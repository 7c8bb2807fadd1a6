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
            fresh_state=[s.req.fresh_state for s in seqs],
            device=self.device,
        )
        input_ids = to_device(ids, torch.long, self.device)
        fill = self._pending_rows(seqs, pending)
        if fill is not None:
            rows, tokens = fill
            ends = to_device([int(e) - 1 for e in itertools.accumulate(s.num_new_tokens for s in seqs)], torch.long,
                             self.device)
            input_ids.index_copy_(0, ends[rows], tokens)
        return input_ids, batch

    def _pending_rows(
        self, seqs: list[ScheduledSeq], pending: PendingTokens | None
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(sequence rows, their token ids) on the device for the sequences whose last new token is
        still pending; None when there are none."""
        rows, src = [], []
        for i, s in enumerate(seqs):
            if s.end > s.req.num_known_tokens:
                if pending is None or s.req not in pending.rows or s.end != s.req.num_known_tokens + 1:
                    raise RuntimeError(f"request {s.req.request_id}: a scheduled token's id is not known")
                rows.append(i)
                src.append(pending.rows[s.req])
        if not rows:
            return None
        return to_device(rows, torch.long, self.device), pending.token_ids[to_device(src, torch.long, self.device)]

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
        logits = self.graphs.run(
            token_ids=[_token_at(s.req, s.start) for s in seqs],
            context_lens=[s.end for s in seqs],
            block_tables=[s.req.block_ids for s in seqs],
            state_slots=[s.req.state_slot for s in seqs],
            fresh_state=[s.req.fresh_state for s in seqs],
            device_tokens=self._pending_rows(seqs, pending),
        )
        sample_rows = [i for i, s in enumerate(seqs) if s.samples]
        if len(sample_rows) < len(seqs):  # a one-token prefill chunk that does not reach the prompt's end
            logits = logits[to_device(sample_rows, torch.long, self.device)]
        return StepLogits(sample_rows, logits, {})


def _token_at(req: Request, i: int) -> int:
    # all_token_ids would concatenate the whole sequence for every row of every step
    n = req.num_prompt_tokens
    if i >= req.num_known_tokens:
        return 0  # a pending token's placeholder: its id is copied on the device
    return req.prompt_token_ids[i] if i < n else req.output_token_ids[i - n]
