"""Turns a scheduled step into one flattened forward and gathers only the logits that are used."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hyserve.engine.cuda_graphs import DecodeGraphs
from hyserve.engine.kv_cache import KVCacheManager
from hyserve.engine.request import Request
from hyserve.engine.scheduler import ScheduledSeq, SchedulerOutput
from hyserve.models.batch import Batch
from hyserve.models.kimi import KimiForCausalLM


@dataclass
class StepLogits:
    sample_rows: list[int]  # indices into out.seqs of the sequences that sample a token
    logits: torch.Tensor  # [len(sample_rows), V] float32
    prompt_logits: dict[int, torch.Tensor]  # seq index -> [num_new_tokens, V] for prompt_logprobs


def _wants_prompt_logits(s: ScheduledSeq) -> bool:
    return s.req.params.prompt_logprobs is not None and s.start < s.req.num_prompt_tokens


class ModelRunner:
    def __init__(self, model: KimiForCausalLM, kv: KVCacheManager, graphs: DecodeGraphs | None = None):
        """`graphs`: decode steps that fit its ladder run through its static buffers (replayed CUDA
        graphs on the GPU); every other step runs eagerly."""
        self.model, self.kv, self.graphs = model, kv, graphs
        self.device = model.device

    def build_batch(self, out: SchedulerOutput) -> tuple[torch.Tensor, Batch]:
        seqs = out.seqs
        ids: list[int] = []
        for s in seqs:
            ids.extend(s.req.all_token_ids[s.start : s.end])
        batch = Batch.build(
            query_lens=[s.num_new_tokens for s in seqs],
            context_lens=[s.end for s in seqs],
            block_tables=[s.req.block_ids for s in seqs],
            block_size=self.kv.block_size,
            state_slots=[s.req.state_slot for s in seqs],
            fresh_state=[s.req.fresh_state for s in seqs],
            device=self.device,
        )
        return torch.tensor(ids, dtype=torch.long, device=self.device), batch

    def uses_graph(self, out: SchedulerOutput) -> bool:
        """One new token per sequence, no prompt logprobs, and a batch the ladder covers."""
        if self.graphs is None or not out.seqs:
            return False
        if any(s.num_new_tokens != 1 or _wants_prompt_logits(s) for s in out.seqs):
            return False
        return self.graphs.size_for(len(out.seqs), max(len(s.req.block_ids) for s in out.seqs)) is not None

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> StepLogits:
        if self.uses_graph(out):
            return self._execute_graph(out)
        input_ids, batch = self.build_batch(out)
        hidden = self.model(input_ids, batch, self.kv.tensors)
        cu = batch.cu_seqlens.tolist()
        sample_rows = [i for i, s in enumerate(out.seqs) if s.samples]
        last = torch.tensor([cu[i + 1] - 1 for i in sample_rows], dtype=torch.long, device=self.device)
        logits = self.model.compute_logits(hidden[last])
        prompt_logits = {}
        for i, s in enumerate(out.seqs):
            if _wants_prompt_logits(s):
                end = min(s.end, s.req.num_prompt_tokens)
                prompt_logits[i] = self.model.compute_logits(hidden[cu[i] : cu[i] + end - s.start])
        return StepLogits(sample_rows, logits, prompt_logits)

    def _execute_graph(self, out: SchedulerOutput) -> StepLogits:
        seqs = out.seqs
        logits = self.graphs.run(
            token_ids=[_token_at(s.req, s.start) for s in seqs],
            context_lens=[s.end for s in seqs],
            block_tables=[s.req.block_ids for s in seqs],
            state_slots=[s.req.state_slot for s in seqs],
            fresh_state=[s.req.fresh_state for s in seqs],
        )
        sample_rows = [i for i, s in enumerate(seqs) if s.samples]
        if len(sample_rows) < len(seqs):  # a one-token prefill chunk that does not reach the prompt's end
            logits = logits[torch.tensor(sample_rows, dtype=torch.long, device=self.device)]
        return StepLogits(sample_rows, logits, {})


def _token_at(req: Request, i: int) -> int:
    # all_token_ids would concatenate the whole sequence for every row of every step
    n = req.num_prompt_tokens
    return req.prompt_token_ids[i] if i < n else req.output_token_ids[i - n]
