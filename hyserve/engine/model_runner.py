"""Turns a scheduled step into one flattened forward and gathers only the logits that are used."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hyserve.engine.kv_cache import KVCacheManager
from hyserve.engine.scheduler import SchedulerOutput
from hyserve.models.batch import Batch
from hyserve.models.kimi import KimiForCausalLM


@dataclass
class StepLogits:
    sample_rows: list[int]  # indices into out.seqs of the sequences that sample a token
    logits: torch.Tensor  # [len(sample_rows), V] float32
    prompt_logits: dict[int, torch.Tensor]  # seq index -> [num_new_tokens, V] for prompt_logprobs


class ModelRunner:
    def __init__(self, model: KimiForCausalLM, kv: KVCacheManager):
        self.model, self.kv = model, kv
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

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> StepLogits:
        input_ids, batch = self.build_batch(out)
        hidden = self.model(input_ids, batch, self.kv.tensors)
        cu = batch.cu_seqlens.tolist()
        sample_rows = [i for i, s in enumerate(out.seqs) if s.samples]
        last = torch.tensor([cu[i + 1] - 1 for i in sample_rows], dtype=torch.long, device=self.device)
        logits = self.model.compute_logits(hidden[last])
        prompt_logits = {}
        for i, s in enumerate(out.seqs):
            if s.req.params.prompt_logprobs is not None and s.start < s.req.num_prompt_tokens:
                end = min(s.end, s.req.num_prompt_tokens)
                prompt_logits[i] = self.model.compute_logits(hidden[cu[i] : cu[i] + end - s.start])
        return StepLogits(sample_rows, logits, prompt_logits)
