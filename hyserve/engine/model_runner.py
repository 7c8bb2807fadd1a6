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
from hyserve.engine.phases import phase
from hyserve.engine.scheduler import ScheduledSeq, SchedulerOutput
from hyserve.engine.step_inputs import PendingTokens, StepInputs, build_step_inputs
from hyserve.models.batch import to_device
from hyserve.models.kimi import KimiForCausalLM
from hyserve.models.segment_graphs import SegmentGraphs
from hyserve.spec_decode.target_features import tap_features


@dataclass
class StepLogits:
    sample_rows: list[int]  # indices into out.seqs of the sequences that sample a token
    logits: torch.Tensor  # [len(sample_rows), V] float32
    prompt_logits: dict[int, torch.Tensor]  # seq index -> [num_new_tokens, V] for prompt_logprobs
    # [T, m*D] the hidden states after the runner's feature layers for every token of the step (a
    # drafter's context); None unless the runner was built with feature layers
    features: torch.Tensor | None = None
    graph: bool = False  # the step ran through the decode graphs' static buffers


def _wants_prompt_logits(s: ScheduledSeq) -> bool:
    return s.req.params.prompt_logprobs is not None and s.start < s.req.num_prompt_tokens


def _row_tokens(seqs: list[ScheduledSeq]) -> int | None:
    """The tokens per row of the graph a step replays: 1 when every sequence is a decode, 1 + the most
    drafts when they are decodes and verify rows (the shorter rows padded to it), else None (a step a
    graph does not cover: prefill chunks)."""
    q = 1 + max(len(s.draft_ids) for s in seqs)
    if any(s.num_new_tokens != 1 + len(s.draft_ids) for s in seqs):
        return None
    if q > 1 and any(not s.draft_ids and (s.fresh or s.end < s.req.num_prompt_tokens) for s in seqs):
        return None  # a prompt's one-token chunk is not a decode: it runs as a prefill, eagerly
    return q


def _row_blocks(seqs: list[ScheduledSeq], q: int, block_size: int) -> int:
    """The block-table columns the rows read: a row padded to q tokens reads up to position start + q - 1."""
    return max(max(len(s.req.block_ids), -(-(s.start + q) // block_size)) for s in seqs)


class ModelRunner:
    def __init__(self, model: KimiForCausalLM, kv: KVCacheManager, graphs: DecodeGraphs | None = None,
                 feature_layers: list[int] | None = None, segments: SegmentGraphs | None = None):
        """`graphs`: decode steps that fit its ladder run through its static buffers (replayed CUDA
        graphs on the GPU); every other step runs eagerly, its layers' MLP halves through `segments`'
        graphs where a size fits. `feature_layers`: every step also returns the hidden states after these
        target layers (`StepLogits.features`; the graphs must tap the same)."""
        self.model, self.kv, self.graphs, self.segments = model, kv, graphs, segments
        self.feature_layers = feature_layers
        self.device = model.device
        self._pin = self.device.type == "cuda"

    def uses_graph(self, out: SchedulerOutput) -> bool:
        """The same number of new tokens in every sequence (one, or 1 + k for verify rows that all carry k
        drafts), no prompt logprobs, and a batch the ladder of that length covers."""
        if self.graphs is None or not out.seqs:
            return False
        q = _row_tokens(out.seqs)
        if q is None or any(_wants_prompt_logits(s) for s in out.seqs):
            return False
        if any(s.start + q > self.graphs.max_model_len for s in out.seqs):
            return False  # a short row's padding would run past the positions the model has
        blocks = _row_blocks(out.seqs, q, self.kv.block_size)
        return self.graphs.size_for(len(out.seqs), blocks, q) is not None

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, pending: PendingTokens | None = None) -> StepLogits:
        """`pending`: where the ids of tokens sampled by the step before but not yet read back are."""
        with phase("step_inputs"):
            graph = self.uses_graph(out)
            inputs, pending = self._graph_inputs(out.seqs, pending) if graph else (
                build_step_inputs(out.seqs, self.kv.block_size, pending, pin=self._pin), pending)
        prompt_rows = {} if graph else {i: min(s.end, s.req.num_prompt_tokens) - s.start
                                        for i, s in enumerate(out.seqs) if _wants_prompt_logits(s)}
        with phase("forward_launch"):
            logits = self.run(inputs, pending.token_ids if inputs.pending else None, prompt_rows, graph)
        logits.graph = graph
        return logits

    def _graph_inputs(self, seqs: list[ScheduledSeq], pending: PendingTokens | None) -> tuple[StepInputs, PendingTokens | None]:
        graphs, kv = self.graphs, self.kv
        if pending is not None and pending.token_ids.numel() > graphs.max_prev:
            pending = pending.only([s.req for s in seqs])  # more sampled rows than the buffer holds
        q = _row_tokens(seqs)
        longest = _row_blocks(seqs, q, kv.block_size)
        size = graphs.size_for(len(seqs), longest, q)
        inputs = build_step_inputs(
            seqs, kv.block_size, pending, pad=graphs.padding(size, q),
            width=graphs.table_width(size, longest), prev_len=graphs.max_prev, sampled=False, pin=self._pin,
        )
        return inputs, pending

    @torch.inference_mode()
    def run(self, inputs: StepInputs, prev: torch.Tensor | None, prompt_rows: dict[int, int], graph: bool) -> StepLogits:
        """The device half of a step, from its inputs alone (what each rank of a parallel engine runs): `prev`
        the previous step's ids the id sources point into, `prompt_rows` each prompt-logprobs sequence's rows
        of prompt logits, `graph` whether the inputs are laid out for the decode graphs' static buffers."""
        if graph:
            logits = self.graphs.run(inputs, prev)
            feats = None if self.feature_layers is None else self.graphs.features[: logits.shape[0]]
            if inputs.real_tokens is not None:  # rows padded to the graph's length: their own tokens only
                logits = logits[to_device(inputs.sample_tokens, torch.long, self.device)]
                if feats is not None:
                    feats = feats[to_device(inputs.real_tokens, torch.long, self.device)]
            elif len(inputs.sample_rows) < len(inputs.query_lens):  # a 1-token chunk that does not end its prompt
                logits = logits[to_device(inputs.sample_rows, torch.long, self.device)]
            return StepLogits(inputs.sample_rows, logits, {}, feats)
        v = inputs.layout.views(inputs.flat.to(self.device, non_blocking=True))
        ids = v.input_ids
        if inputs.pending:
            ids = torch.cat([prev, ids]).index_select(0, v.id_sources)
        with tap_features(self.model, self.feature_layers or []) as tap:
            batch = v.batch(inputs.query_lens, inputs.context_lens, inputs.verify)
            extra = {} if self.segments is None else {"segments": self.segments}  # (rank models take none)
            hidden = self.model(ids, batch, self.kv.tensors, **extra)
        logits = self.model.compute_logits(hidden[v.logits_indices])
        cu = [0, *itertools.accumulate(inputs.query_lens)]  # host values: reading cu_seqlens back would sync
        prompt_logits = {i: self.model.compute_logits(hidden[cu[i] : cu[i] + n]) for i, n in prompt_rows.items()}
        return StepLogits(inputs.sample_rows, logits, prompt_logits, tap.features() if self.feature_layers else None)
