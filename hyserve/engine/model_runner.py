"""Turns a scheduled step into one flattened forward and gathers only the logits that are used. The step's
inputs come from `build_step_inputs` (engine/step_inputs.py) for both paths: an eager step runs on views
of their device copy, a decode step the graph ladder covers replays over the static buffers they are
copied into."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from hyserve.engine.cuda_graphs import DecodeGraphs
from hyserve.engine.kv_cache import KVCacheManager
from hyserve.engine.scheduler import ScheduledSeq, SchedulerOutput
from hyserve.engine.step_inputs import Padding, PendingTokens, build_step_inputs
from hyserve.models.batch import to_device
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
        self._pin = self.device.type == "cuda"

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
        inputs = build_step_inputs(out.seqs, self.kv.block_size, pending, pin=self._pin)
        v = inputs.layout.views(inputs.flat.to(self.device, non_blocking=True))
        ids = v.input_ids
        if inputs.pending:
            ids = torch.cat([pending.token_ids, ids]).index_select(0, v.id_sources)
        hidden = self.model(ids, v.batch(inputs.query_lens, inputs.context_lens), self.kv.tensors)
        logits = self.model.compute_logits(hidden[v.logits_indices])
        cu = [0, *itertools.accumulate(inputs.query_lens)]  # host values: reading cu_seqlens back would sync
        prompt_logits = {}
        for i, s in enumerate(out.seqs):
            if _wants_prompt_logits(s):
                end = min(s.end, s.req.num_prompt_tokens)
                prompt_logits[i] = self.model.compute_logits(hidden[cu[i] : cu[i] + end - s.start])
        return StepLogits(inputs.sample_rows, logits, prompt_logits)

    def _execute_graph(self, out: SchedulerOutput, pending: PendingTokens | None) -> StepLogits:
        graphs, seqs, kv = self.graphs, out.seqs, self.kv
        if pending is not None and pending.token_ids.numel() > graphs.max_prev:
            pending = pending.only([s.req for s in seqs])  # more sampled rows than the buffer holds
        longest = max(len(s.req.block_ids) for s in seqs)
        size = graphs.size_for(len(seqs), longest)
        inputs = build_step_inputs(
            seqs, kv.block_size, pending, pad=Padding(size, kv.scratch_block, kv.scratch_slot),
            width=graphs.table_width(size, longest), prev_len=graphs.max_prev, sampled=False, pin=self._pin,
        )
        logits = graphs.run(inputs, pending.token_ids if inputs.pending else None)
        if len(inputs.sample_rows) < len(seqs):  # a one-token prefill chunk that does not reach the prompt's end
            logits = logits[to_device(inputs.sample_rows, torch.long, self.device)]
        return StepLogits(inputs.sample_rows, logits, {})
