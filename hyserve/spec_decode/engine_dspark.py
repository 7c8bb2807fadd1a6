"""DSpark drafting inside the engine loop (docs/speculative_decoding.md §2).

Every step's forward hands back the target's features (`StepLogits.features`: the model runner taps the
drafter's target layers, and the CUDA graphs copy the same taps into a static buffer they replay), so
dspark runs with graphs, verify graphs included. The drafter's context rows of a request are kept by
`DSparkProposer` (per request) and extended with the rows of computed positions only: a prefill chunk or
plain decode adds all of its positions at once, a verify step only the positions of its accepted drafts,
after rejection sampling. The rows a step adds are computed in one drafter call for all its requests
(`DSparkProposer.flush`, before the next forward can overwrite a graph's feature buffer). A request drafts
once the rows of every token before its last one exist; the step's drafting needs one host-to-device
copy (lengths, positions, anchors) and one read-back (the drafts, with the verified counts under a
confidence threshold). With CUDA graphs on, `capture_graphs` gives the proposer `DSparkGraphs`, and
drafting blocks replay them (sampled ones under draft_sample_method "probabilistic"); the rows' drafter
call runs eagerly; paged drafter rows are still to come. A prefix hit skips the target features of its cached tokens: such a request drafts from the
context computed after the hit (fewer drafts accepted on long shared prefixes, the same output).

A `DraftBudget` (draft_budget.py, threshold 0: the confidence head cuts the prefix where configured) decides
before drafting whether a step's drafts pay for the verify step and the drafter's forward; requests it turns
down draft nothing, and a step where nobody drafts runs no drafter forward. While no running request may
draft, the context rows are not computed every step (an eager drafter call of many small kernels): the
step's features are copied once, out of the graph buffer's reach, and queued until drafting resumes (the
proposer computes its queue before drafting) or more than MAX_DEFERRED_ROWS positions would wait. `confidence_threshold` 0
(or a synthetic curve) verifies every draft, without a budget.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from hyserve.engine.cuda_graphs import MAX_VERIFY_SEQS, graph_batch_sizes
from hyserve.engine.phases import phase, phased
from hyserve.spec_decode.confidence import threshold_lengths
from hyserve.spec_decode.config import SpeculativeConfig
from hyserve.spec_decode.draft_budget import DraftBudget, drafted_step_seconds
from hyserve.spec_decode.dspark import DSparkDrafter
from hyserve.spec_decode.dspark_graphs import DSparkGraphs, bytes_per_row, width_ladder
from hyserve.spec_decode.dspark_io import load_drafter
from hyserve.spec_decode.dspark_propose import DSparkProposer
from hyserve.spec_decode.engine_step import SpecDecoder, target_step_cost
from hyserve.spec_decode.target_features import feature_modules

if TYPE_CHECKING:
    from hyserve.engine.model_runner import ModelRunner, StepLogits
    from hyserve.engine.request import Request
    from hyserve.engine.scheduler import ScheduledSeq, SchedulerOutput
    from hyserve.engine.step_inputs import PendingTokens


# at most this many positions' context rows wait (a step that would queue more computes them all): a budget
# that never lets anyone draft (no drafts could pay even at full acceptance) must not keep every step's
# features forever, and a long prefill chunk is computed at once rather than copied
MAX_DEFERRED_ROWS = 4096


def dspark_budget(spec: SpeculativeConfig, model: torch.nn.Module, drafter: DSparkDrafter) -> DraftBudget | None:
    """The draft budget of a DSpark drafter: none at confidence_threshold 0 or under a synthetic curve."""
    if spec.confidence_threshold == 0 or spec.rejection_sample_method == "synthetic":
        return None
    return DraftBudget(0.0, drafted_step_seconds(*target_step_cost(model), drafter.drafting_bytes()))


class DSparkDecoder(SpecDecoder):
    def __init__(self, spec: SpeculativeConfig, max_model_len: int, model: torch.nn.Module, scheduler):
        drafter = load_drafter(spec.model, model)
        super().__init__(spec, max_model_len, scheduler, dspark_budget(spec, model, drafter))
        try:  # the layers exist and their outputs can be read
            feature_modules(model, drafter.config.target_layer_ids)
        except NotImplementedError as e:
            raise ValueError(f"speculative method 'dspark' needs a K3 target: {e}") from None
        self.model, self.max_model_len = model, max_model_len
        self.feature_layers = list(drafter.config.target_layer_ids)  # every step's forward returns them
        self.proposer = DSparkProposer(drafter, spec.num_speculative_tokens)
        self.probs: dict[str, torch.Tensor] = {}  # request -> [k, V] the distributions of its drafts
        self._verify_rows: dict[Request, tuple[torch.Tensor, int]] = {}  # its features and first position

    def execute(self, runner: ModelRunner, out: SchedulerOutput, pending: PendingTokens | None) -> StepLogits:
        """The step's forward with the target features tapped; the rows of every computed position but
        verify rows' go to the drafter's context now, verify rows' wait for the accepted count. While the
        budget lets no running request draft, the rows wait too (deferred, see the module docstring)."""
        self.forget(self.scheduler.running + self.scheduler.waiting)
        logits = runner.execute(out, pending)
        feats, at = logits.features, 0
        defer = (not self.may_draft(self.scheduler.running)
                 and self.proposer.queued_rows + feats.shape[0] <= MAX_DEFERRED_ROWS)
        # a graph's feature buffer is the next replay's output: what outlives this step is a copy, one for
        # the whole step when the rows wait (every request's rows are views of it), else the verify rows'
        if defer:
            feats = feats.clone()
        for s in out.seqs:
            rows, at = feats[at : at + s.num_new_tokens], at + s.num_new_tokens
            if s.draft_ids:
                self._verify_rows[s.req] = (rows if defer else rows.clone(), s.start)
            else:
                self._add(s.req, rows, s.start)
        if not defer:
            self.proposer.flush()  # before the next forward overwrites a graph's feature buffer
        return logits

    def capture_graphs(self, max_batch: int) -> None:
        """Drafting through `DSparkGraphs` (sampled drafting too under draft_sample_method "probabilistic"):
        batch sizes up to the largest batch that still speculates (and MAX_VERIFY_SEQS, the verify graphs'
        bound), widths up to max_model_len's bucket."""
        cap = min(max_batch, MAX_VERIFY_SEQS, (self.config.disable_by_batch_size or max_batch + 1) - 1)
        drafter = self.proposer.drafter
        max_rows = None  # on CUDA: a quarter of what the cache left, like the MLP segment graphs
        if drafter.fc.weight.is_cuda:
            max_rows = torch.cuda.mem_get_info(drafter.fc.weight.device)[0] // 4 // bytes_per_row(drafter)
        graphs = DSparkGraphs(drafter, self.proposer.k, graph_batch_sizes(cap), width_ladder(self.max_model_len),
                              max_rows, sampled=self.config.draft_sample_method == "probabilistic")
        graphs.capture()
        self.proposer.graphs = graphs

    def _add(self, req: Request, rows: torch.Tensor, start: int) -> None:
        proposer, rid = self.proposer, req.request_id
        proposer.truncate(rid, start)  # a preempted request computes again from 0 or from a prefix hit
        if rid in proposer.stores and proposer.num_context(rid) != start:  # a hit past its rows: start there
            proposer.free(rid)
        proposer.extend(rid, rows, start)  # positions start.. as host ints: no device round trip, no tensor op

    def after_verify(self, seqs: Sequence[ScheduledSeq]) -> None:
        """The accepted positions' rows join the context before drafting, so the request drafts again at once."""
        for s in seqs:
            rows, start = self._verify_rows.pop(s.req, (None, 0))
            if rows is not None and not s.req.is_finished:
                self._add(s.req, rows[: s.req.num_computed_tokens - start], start)
        self._verify_rows.clear()
        super().after_verify(seqs)

    @phased("propose")
    def propose(self, reqs: Sequence[Request]) -> None:
        for r in reqs:
            r.spec_token_ids = []
            self.probs.pop(r.request_id, None)
        self._landed_without_verify(reqs)
        ctx = self.proposer.num_context
        live = [r for r in reqs if not r.is_finished and r.matcher is None and not r.num_pending
                and ctx(r.request_id) == r.num_tokens - 1 and r.output_token_ids]
        for r in reqs:
            if r.is_finished:
                self.proposer.free(r.request_id)
        if not live or not self.scheduler.speculating():  # under load the drafter's forward is saved too
            return
        k = self.proposer.k
        allowed = [k] * len(live)
        if self.budget is not None:  # before drafting: drafts that could not pay cost no drafter forward
            allowed = self.budget.lengths([r.request_id for r in live], allowed, len(self.scheduler.running))
            live, allowed = [r for r, n in zip(live, allowed) if n], [n for n in allowed if n]
            if not live:
                return
        anchors = torch.tensor([r.output_token_ids[-1] for r in live])  # travels with the step's other inputs
        probabilistic = self.config.draft_sample_method == "probabilistic"
        temps = [0.0 if r.params.is_greedy else r.params.temperature for r in live] if probabilistic else None
        block = self.proposer.propose([r.request_id for r in live], anchors, temps, [r.generator for r in live])
        out = block.token_ids
        if self.config.confidence_threshold is not None:
            # the verified prefix ends where the predicted survival falls below the threshold; confidence j
            # reads h_j and draft j-1, never draft j, so the cut is a stopping rule and the output stays exact
            room = threshold_lengths(block.confidence, self.config.confidence_threshold)
            out = torch.cat([out, room.to(out.dtype).unsqueeze(1)], 1)
        with phase("readback"):
            rows = out.tolist()  # one read-back for the batch: the drafts, then the verified count if cut
        for i, r in enumerate(live):
            room = min(rows[i][k] if len(rows[i]) > k else k, allowed[i])
            n = max(0, min(room, self.proposer.drafter.config.max_position_embeddings - r.num_tokens))
            r.spec_token_ids = rows[i][:n]
            if block.probs is not None:
                self.probs[r.request_id] = block.probs[i, :n]

    def draft_probs(self, seqs: Sequence[ScheduledSeq], vocab: int) -> torch.Tensor | None:
        """[sum k, V] the distributions the step's drafts were drawn from; None when all are one-hot."""
        if not any(s.req.request_id in self.probs for s in seqs if s.draft_ids):
            return None
        parts = []
        for s in seqs:
            if not s.draft_ids:
                continue
            q = self.probs.get(s.req.request_id)
            if q is None:  # greedy: the draft was the argmax
                q = torch.nn.functional.one_hot(torch.tensor(list(s.draft_ids)), vocab).float()
            parts.append(q[: len(s.draft_ids)].to(self.model.lm_head.weight.device))
        return torch.cat(parts)

    def forget(self, running: Sequence[Request]) -> None:
        """Drop the rows (queued ones too) and the acceptance records of requests that left (finished or
        aborted)."""
        keep = {r.request_id for r in running}
        for rid in [r for r in self.proposer.stores if r not in keep]:
            self.proposer.free(rid)
            self.probs.pop(rid, None)
        if self.budget is not None and len(self.budget) > len(keep):
            self.budget.retain(keep)

