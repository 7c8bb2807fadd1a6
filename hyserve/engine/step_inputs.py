"""One step's model inputs, built once on the host by `build_step_inputs` (docs/ARCHITECTURE.md, "Step
inputs").

Everything the host knows about a step goes into ONE int64 buffer (pinned when bound for CUDA), so it
reaches the device in one non-blocking copy:

    tokens [4, T]    input ids (0 where the id is still on the device), positions, slot mapping, id sources
    seqs   [2, N]    context lens, state slots
    cu     [N + 1]   cu_seqlens
    logits [S]       the index of each sampling sequence's last token
    fresh  [N] bool  bytes of the buffer's words, padded to 8 bytes
    tables [N, W]    block tables, -1 past each row's blocks (last: a wide table can travel on its own)

Ids sampled by the step before and not read back yet (async scheduling) stay on the device: the forward
gathers token t's id from `[previous step's ids | ids row]` at its source index (prev_len + t where the
host knew the id), one kernel and no host round trip. An eager step uses views of the device copy
directly; a CUDA-graph replay copies the buffer into its static region of the same layout
(engine/cuda_graphs.py), padded with rows that write only the scratch page and slot.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from hyserve.engine.request import Request
from hyserve.engine.scheduler import ScheduledSeq
from hyserve.models.batch import Batch


@dataclass
class PendingTokens:
    """The step before's sampled token ids, still on the device (async scheduling): row `rows[req]` of
    `token_ids` is the token at req's last position."""

    token_ids: torch.Tensor  # [M] long
    rows: dict[Request, int]

    def only(self, reqs: list[Request]) -> PendingTokens:
        """The rows of `reqs` alone, gathered on the device and renumbered."""
        keep = [r for r in reqs if r in self.rows]
        idx = torch.tensor([self.rows[r] for r in keep], dtype=torch.long)
        return PendingTokens(self.token_ids[idx.to(self.token_ids.device, non_blocking=True)],
                             {r: k for k, r in enumerate(keep)})


@dataclass(frozen=True)
class StepLayout:
    num_tokens: int
    num_seqs: int
    num_sampled: int
    width: int  # block-table columns

    @property
    def table_offset(self) -> int:
        t, n = self.num_tokens, self.num_seqs
        return 4 * t + 3 * n + 1 + self.num_sampled + -(-n // 8)

    @property
    def words(self) -> int:
        return self.table_offset + self.num_seqs * self.width

    def views(self, flat):
        """The named rows of `flat` (a torch tensor or a numpy array of this layout)."""
        t, n, s, o = self.num_tokens, self.num_seqs, self.num_sampled, self.table_offset
        tok, seq = flat[: 4 * t].reshape(4, t), flat[4 * t : 4 * t + 2 * n].reshape(2, n)
        cu = 4 * t + 2 * n
        fresh = flat[cu + n + 1 + s : o]
        fresh = fresh.view(torch.bool if isinstance(flat, torch.Tensor) else np.bool_)[:n]
        return StepViews(tok[0], tok[1], tok[2], tok[3], seq[0], seq[1], flat[cu : cu + n + 1],
                         flat[cu + n + 1 : cu + n + 1 + s], fresh, flat[o : o + n * self.width].reshape(n, self.width))


@dataclass
class StepViews:
    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    id_sources: torch.Tensor
    context_lens: torch.Tensor
    state_slots: torch.Tensor
    cu_seqlens: torch.Tensor
    logits_indices: torch.Tensor
    fresh_state: torch.Tensor
    block_tables: torch.Tensor

    def batch(self, query_lens: list[int], context_lens: list[int]) -> Batch:
        return Batch(query_lens, context_lens, self.cu_seqlens, self.positions, self.block_tables, self.slot_mapping,
                     self.state_slots, self.fresh_state, context_lens_device=self.context_lens)


@dataclass
class StepInputs:
    flat: torch.Tensor  # the packed host buffer
    layout: StepLayout
    query_lens: list[int]  # the real rows' (no padding)
    context_lens: list[int]
    sample_rows: list[int]  # indices into the step's seqs of the sequences that sample a token
    pending: bool  # some id comes from the previous step's device tensor


@dataclass(frozen=True)
class Padding:
    """Pad a decode step to `rows` rows that decode token 0 at position 0 into the scratch page and slot."""

    rows: int
    scratch_block: int
    scratch_slot: int


def _token_at(req: Request, i: int) -> int:
    n = req.num_prompt_tokens
    if i >= req.num_known_tokens:
        return 0  # a pending token's placeholder: its id is gathered on the device
    return req.prompt_token_ids[i] if i < n else req.output_token_ids[i - n]


def _known_ids(req: Request, start: int, end: int) -> list[int]:
    """Token ids start..end-1 the host knows (a pending last one is left out); all_token_ids would
    concatenate the whole sequence for every row of every step."""
    n = req.num_prompt_tokens
    if end <= n:
        return req.prompt_token_ids[start:end]
    if start >= n:
        return req.output_token_ids[start - n : end - n]
    return req.prompt_token_ids[start:] + req.output_token_ids[: end - n]


def build_step_inputs(seqs: list[ScheduledSeq], block_size: int, pending: PendingTokens | None = None, *,
                      pad: Padding | None = None, width: int | None = None, prev_len: int | None = None,
                      sampled: bool = True, pin: bool = False) -> StepInputs:
    """The inputs of a step of `seqs`. `pad`: rows added past the real ones (CUDA graphs); `width`: table
    columns (default the longest table); `prev_len`: the previous ids' length in the gather pool (default
    pending's); `sampled`: lay out the logits gather indices; `pin`: a pinned buffer (bound for CUDA)."""
    q = [s.num_new_tokens for s in seqs]
    ctx = [s.end for s in seqs]
    tables = [s.req.block_ids for s in seqs]
    rows = [i for i, s in enumerate(seqs) if s.samples]
    m = len(seqs)
    n = pad.rows if pad is not None else m
    t = n if pad is not None else sum(q)
    w = width or max(map(len, tables), default=1) or 1
    layout = StepLayout(t, n, len(rows) if sampled else 0, w)
    flat = torch.empty(layout.words, dtype=torch.long, pin_memory=pin)
    v = layout.views(flat.numpy())
    v.block_tables.fill(-1)
    lens = np.fromiter(map(len, tables), dtype=np.int64, count=m)
    v.block_tables[:m][np.arange(w) < lens[:, None]] = np.fromiter(
        (b for tb in tables for b in tb), dtype=np.int64, count=int(lens.sum()))
    v.context_lens[:m], v.state_slots[:m], v.fresh_state[:m] = ctx, [s.req.state_slot for s in seqs], [s.fresh for s in seqs]
    v.cu_seqlens[0] = 0
    np.cumsum(q, out=v.cu_seqlens[1 : m + 1])
    _fill_tokens(v, seqs, q, ctx, block_size)
    if sampled:
        v.logits_indices[:] = v.cu_seqlens[1:][rows] - 1
    if pad is not None:  # decode steps only: one token per row
        v.context_lens[m:], v.state_slots[m:], v.fresh_state[m:] = 1, pad.scratch_slot, True
        v.input_ids[m:], v.positions[m:], v.slot_mapping[m:] = 0, 0, pad.scratch_block * block_size
        v.cu_seqlens[m + 1 :] = np.arange(m + 1, n + 1)
        v.block_tables[m:, 0] = pad.scratch_block
    if prev_len is None:
        prev_len = pending.token_ids.numel() if pending is not None else 0
    return StepInputs(flat, layout, q, ctx, rows, _fill_sources(v, seqs, pending, prev_len))


def _fill_tokens(v: StepViews, seqs: list[ScheduledSeq], q: list[int], ctx: list[int], block_size: int) -> None:
    """ids, positions and slot mapping: one python pass over the sequences, the per-token work vectorized."""
    m = len(seqs)
    if all(k == 1 for k in q):  # decode: a row per sequence
        v.input_ids[:m] = [_token_at(s.req, s.start) for s in seqs]
        pos, seq_of = np.asarray(ctx, dtype=np.int64) - 1, np.arange(m)
    else:
        at = 0
        for s in seqs:
            known = _known_ids(s.req, s.start, s.end)
            v.input_ids[at : at + len(known)] = known
            v.input_ids[at + len(known) : at + s.num_new_tokens] = 0  # a pending token's placeholder
            at += s.num_new_tokens
        qa = np.asarray(q, dtype=np.int64)
        seq_of = np.repeat(np.arange(m), qa)
        pos = np.repeat(np.asarray(ctx, dtype=np.int64) - qa - v.cu_seqlens[:m], qa) + np.arange(at)
    t = len(pos)
    v.positions[:t] = pos
    v.slot_mapping[:t] = v.block_tables[seq_of, pos // block_size] * block_size + pos % block_size


def _fill_sources(v: StepViews, seqs, pending: PendingTokens | None, prev_len: int) -> bool:
    """Each token's id source: prev_len + t (the ids row), or the previous step's row of a pending id."""
    src = v.id_sources
    src[:] = np.arange(prev_len, prev_len + len(src))
    found, end = False, 0
    for s in seqs:
        end += s.num_new_tokens
        if s.end > s.req.num_known_tokens:
            if pending is None or s.req not in pending.rows or s.end != s.req.num_known_tokens + 1:
                raise RuntimeError(f"request {s.req.request_id}: a scheduled token's id is not known")
            src[end - 1], found = pending.rows[s.req], True
    return found
