"""One step's model inputs, built once on the host by `build_step_inputs` (docs/ARCHITECTURE.md, "Step
inputs").

Everything the host knows about a step goes into ONE int64 buffer (pinned when bound for CUDA), so it
reaches the device in one non-blocking copy:

    tokens [4, T]    input ids (0 where the id is still on the device), positions, slot mapping, id sources
    seqs   [2, N]    context lens, state slots
    cu     [N + 1]   cu_seqlens
    logits [S]       the index of each sampling sequence's last token
    fresh  [N] bool  bytes of the buffer's words, padded to 8 bytes
    spec   [N, 1+K]  speculative steps: the verify sequences' state-slot rows, first rows first
    src    [N]       and the column of each one's current state
    tables [N, W]    block tables, -1 past each row's blocks (last: a wide table can travel on its own)

each row starting 16-byte aligned.

Ids sampled by the step before and not read back yet (async scheduling) stay on the device: the forward
gathers token t's id from `[previous step's ids | ids row]` at its source index (prev_len + t where the
host knew the id), one kernel and no host round trip. An eager step uses views of the device copy
directly; a CUDA-graph replay copies the buffer into its static region of the same layout
(engine/cuda_graphs.py), padded with rows that write only the scratch page and slot.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import numpy as np
import torch

from hyserve.engine.request import Request
from hyserve.engine.scheduler import ScheduledSeq
from hyserve.models.batch import Batch, VerifyRows, to_device


@dataclass
class PendingTokens:
    """The step before's sampled token ids, still on the device (async scheduling): row `rows[req]` of
    `token_ids` is the token at req's last position."""

    token_ids: torch.Tensor  # [M] long
    rows: dict[Request, int]

    def only(self, reqs: list[Request]) -> PendingTokens:
        """The rows of `reqs` alone, gathered on the device and renumbered."""
        keep = [r for r in reqs if r in self.rows]
        idx = to_device([self.rows[r] for r in keep], torch.long, self.token_ids.device)
        return PendingTokens(self.token_ids[idx], {r: k for k, r in enumerate(keep)})


@dataclass(frozen=True)
class StepLayout:
    num_tokens: int
    num_seqs: int
    num_sampled: int
    width: int  # block-table columns
    spec_width: int = 0  # 1 + K state-slot columns of a verify sequence (0: the step verifies nothing)

    @functools.cached_property
    def offsets(self) -> list[int]:
        """Where each row starts, then the total: 16-byte aligned, so the alignment Triton specializes
        kernels on never changes with the step's sizes (a change would compile another variant)."""
        t, n, v = self.num_tokens, self.num_seqs, self.spec_width
        out, at = [], 0
        for k in (t, t, t, t, n, n, n + 1, self.num_sampled, -(-n // 8), n * v, n if v else 0, n * self.width):
            out.append(at)
            at += k + (k & 1)
        return out + [at]

    @property
    def table_offset(self) -> int:
        return self.offsets[11]

    @property
    def words(self) -> int:
        return self.offsets[12]

    def views(self, flat) -> StepViews:
        """The named rows of `flat` (a torch tensor or a numpy array of this layout)."""
        t, n, v, o = self.num_tokens, self.num_seqs, self.spec_width, self.offsets
        ids, pos, slot, src = (flat[o[i] : o[i] + t] for i in range(4))
        fresh = flat[o[8] : o[9]].view(torch.bool if isinstance(flat, torch.Tensor) else np.bool_)[:n]
        return StepViews(ids, pos, slot, src, flat[o[4] : o[4] + n], flat[o[5] : o[5] + n], flat[o[6] : o[6] + n + 1],
                         flat[o[7] : o[7] + self.num_sampled], fresh,
                         flat[o[11] : o[11] + n * self.width].reshape(n, self.width),
                         flat[o[9] : o[9] + n * v].reshape(n, v), flat[o[10] : o[10] + (n if v else 0)])


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
    spec_slots: torch.Tensor  # [N, 1+K]: row j is verify sequence j's (the first len(verify.seqs) rows)
    spec_src: torch.Tensor  # [N]

    def batch(self, query_lens: list[int], context_lens: list[int], verify: VerifyInputs | None = None) -> Batch:
        rows = None
        if verify is not None:
            nv = len(verify.seqs)
            rows = VerifyRows(verify.seqs, self.spec_slots[:nv], self.spec_src[:nv])
        return Batch(query_lens, context_lens, self.cu_seqlens, self.positions, self.block_tables, self.slot_mapping,
                     self.state_slots, self.fresh_state, context_lens_device=self.context_lens, verify=rows)


@dataclass
class StepInputs:
    flat: torch.Tensor  # the packed host buffer
    layout: StepLayout
    query_lens: list[int]  # the real rows' (no padding)
    context_lens: list[int]
    sample_rows: list[int]  # indices into the step's seqs of the sequences that sample a token
    pending: bool  # some id comes from the previous step's device tensor
    verify: VerifyInputs | None = None  # speculative decoding: the step's verify sequences
    # rows padded to a verify graph's length (None when every row is full): the real tokens' indices in
    # the laid-out tokens, and those of the sampling sequences' tokens (their logits, in verify order)
    real_tokens: list[int] | None = None
    sample_tokens: list[int] | None = None


@dataclass(frozen=True)
class Padding:
    """Pad a step whose rows hold at most `tokens` new tokens (decodes, or verify rows) to `rows` rows of
    `tokens` tokens: shorter rows get padding tokens after their own (writing only the scratch page), and
    the added rows run token 0 at positions 0.. into the scratch page and scratch state slot."""

    rows: int
    scratch_block: int
    scratch_slot: int
    tokens: int = 1
    spec_width: int = 0  # verify rows: their slot rows' width (every column of a padding row is the scratch slot)


def _known_ids(req: Request, start: int, end: int) -> list[int]:
    """Token ids start..end-1 the host knows (a pending last one is left out); all_token_ids would
    concatenate the whole sequence for every row of every step."""
    prompt, n = req.prompt_token_ids, req.num_prompt_tokens
    if end <= n:
        return prompt[start:end]
    if start >= n:
        return req.output_token_ids[start - n : end - n]
    return prompt[start:] + req.output_token_ids[: end - n]


class _Rows:
    """One python pass over a step's sequences: what the vectorized filling needs of each. `row_tokens`: lay
    every row out as that many tokens (a verify graph's query length), a shorter row (a decode, a verify
    row with fewer drafts) followed by padding tokens."""

    def __init__(self, seqs: list[ScheduledSeq], row_tokens: int | None = None):
        self.q, self.ctx, self.tables, self.slots, self.fresh, self.rows, self.ids = [], [], [], [], [], [], []
        self.pending: list[tuple[int, Request]] = []  # (token index, request) of ids still on the device
        self.verify: list[int] = []  # the verify sequences (speculative decoding)
        self.real_q: list[int] = []  # each row's own new tokens (self.q: as laid out)
        self.pad_tokens: list[tuple[int, int]] = []  # (token index, offset in its row) of short rows' padding
        at = 0
        for i, s in enumerate(seqs):
            req, k, start = s.req, s.num_new_tokens, s.start
            end, prompt, outs = start + k, req.prompt_token_ids, req.output_token_ids
            known = len(prompt) + len(outs)
            if k == 1:  # a decode (the common row): its one id, 0 as a pending token's placeholder
                self.ids.append(0 if start >= known else prompt[start] if start < len(prompt) else outs[start - len(prompt)])
            elif s.draft_ids:  # a verify row: the last token, then the drafts (ids the sequence does not hold yet)
                self.verify.append(i)
                end -= len(s.draft_ids)
                self.ids += _known_ids(req, start, end) + list(s.draft_ids)
            else:
                chunk = _known_ids(req, start, end)
                self.ids += chunk + [0] * (k - len(chunk))
            at += k
            if end > known:
                if end != known + 1 or s.draft_ids:
                    raise RuntimeError(f"request {req.request_id}: a scheduled token's id is not known")
                self.pending.append((at - 1, req))
            if end == known + req.num_pending:  # the chunk reaches the last token: it samples
                self.rows.append(i)
            self.real_q.append(k)
            if row_tokens is not None and k < row_tokens:
                if not s.draft_ids:  # a decode among verify rows: a verify row of no drafts (VerifyInputs.of)
                    self.verify.append(i)
                self.pad_tokens += [(at + j - k, j) for j in range(k, row_tokens)]
                self.ids += [0] * (row_tokens - k)
                at, k = at + row_tokens - k, row_tokens
            self.q.append(k)
            self.ctx.append(start + k)
            self.tables.append(req.block_ids)
            self.slots.append(req.state_slot)
            self.fresh.append(s.fresh)
        self.num_tokens = at


@dataclass
class VerifyInputs:
    """The verify sequences of a step (host values): their indices among the step's sequences, each one's row
    of 1+K state slots and the column holding its current state (docs/speculative_decoding.md)."""

    seqs: list[int]
    slot_table: list[list[int]]
    src: list[int]
    logit_counts: list[int]  # logits rows of each sampling sequence: 1 + its drafts

    @classmethod
    def of(cls, seqs: list[ScheduledSeq], r: _Rows, pad: Padding | None = None) -> VerifyInputs:
        """A decode laid out as a verify row (a verify graph's step, `pad` given) reads and writes its state
        in place through column 0 and sends its padding positions' states to the scratch slot, so it lands
        as a decode does; a verify row with fewer drafts than the row length writes its padding positions'
        states into its own later columns, as rejected drafts do."""
        table, src = [], []
        for i in r.verify:
            req = seqs[i].req
            if seqs[i].draft_ids:
                table.append(req.spec_slots)
                src.append(req.spec_slots.index(req.state_slot))
            else:
                table.append([req.state_slot] + [pad.scratch_slot] * (pad.spec_width - 1))
                src.append(0)
        return cls(r.verify, table, src, [1 + len(seqs[i].draft_ids) for i in r.rows])


def _verify_logits(v: StepViews, r: _Rows, spec: VerifyInputs) -> None:
    """Logits at each of a verify sequence's 1+k positions (one per draft, then the bonus row)."""
    counts = np.asarray(spec.logit_counts, dtype=np.int64)
    first = v.cu_seqlens[1:][r.rows] - counts  # each sampling sequence's last 1+k positions
    within = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)  # 0..c-1 per sequence
    v.logits_indices[:] = np.repeat(first, counts) + within


def build_step_inputs(seqs: list[ScheduledSeq], block_size: int, pending: PendingTokens | None = None, *,
                      pad: Padding | None = None, width: int | None = None, prev_len: int | None = None,
                      sampled: bool = True, pin: bool = False) -> StepInputs:
    """The inputs of a step of `seqs`. `pad`: rows added past the real ones (CUDA graphs); `width`: table
    columns (default the longest table); `prev_len`: the previous ids' length in the gather pool (default
    pending's); `sampled`: lay out the logits gather indices; `pin`: a pinned buffer (bound for CUDA)."""
    short = pad is not None and pad.tokens > 1 and any(s.num_new_tokens < pad.tokens for s in seqs)
    r, m = _Rows(seqs, pad.tokens if short else None), len(seqs)
    n = pad.rows if pad is not None else m
    t = n * pad.tokens if pad is not None else r.num_tokens
    w = width or max(map(len, r.tables), default=1) or 1
    spec = VerifyInputs.of(seqs, r, pad) if r.verify else None
    num_logits = (sum(spec.logit_counts) if spec is not None else len(r.rows)) if sampled else 0
    spec_width = pad.spec_width if pad is not None else len(spec.slot_table[0]) if spec is not None else 0
    layout = StepLayout(t, n, num_logits, w, spec_width)
    flat = torch.empty(layout.words, dtype=torch.long, pin_memory=pin)
    v = layout.views(flat.numpy())
    v.block_tables.fill(-1)
    lens = np.fromiter(map(len, r.tables), dtype=np.int64, count=m)
    v.block_tables[:m][np.arange(w) < lens[:, None]] = np.fromiter(
        (b for tb in r.tables for b in tb), dtype=np.int64, count=int(lens.sum()))
    v.context_lens[:m], v.state_slots[:m], v.fresh_state[:m] = r.ctx, r.slots, r.fresh
    v.cu_seqlens[0] = 0
    v.cu_seqlens[1 : m + 1] = list(itertools.accumulate(r.q))  # (np.cumsum of a list: 4x slower at batch 1)
    v.input_ids[: r.num_tokens] = r.ids
    if r.num_tokens == m:  # decode: a token per row
        pos, seq_of = v.context_lens[:m] - 1, np.arange(m)
    else:
        qa = np.asarray(r.q, dtype=np.int64)
        seq_of = np.repeat(np.arange(m), qa)
        pos = np.repeat(v.context_lens[:m] - qa - v.cu_seqlens[:m], qa) + np.arange(r.num_tokens)
    v.positions[: r.num_tokens] = pos
    if r.pad_tokens:  # short rows' padding reads pages past the row's own: the scratch page's, never -1
        need = -(-v.context_lens[:m] // block_size)
        v.block_tables[:m][(np.arange(w) >= lens[:, None]) & (np.arange(w) < need[:, None])] = pad.scratch_block
    v.slot_mapping[: r.num_tokens] = v.block_tables[seq_of, pos // block_size] * block_size + pos % block_size
    real_tokens = sample_tokens = None
    if r.pad_tokens:  # ... and writes only the scratch page
        at, offset = np.asarray(r.pad_tokens, dtype=np.int64).T
        v.slot_mapping[at] = pad.scratch_block * block_size + offset
        q = pad.tokens
        real_tokens = [i * q + j for i, k in enumerate(r.real_q) for j in range(k)]
        sample_tokens = [i * q + j for i in r.rows for j in range(r.real_q[i])]
    if spec is not None:
        nv = len(r.verify)
        v.spec_slots[:nv], v.spec_src[:nv] = spec.slot_table, spec.src
    if sampled and spec is not None:
        _verify_logits(v, r, spec)
    elif sampled:
        v.logits_indices[:] = v.cu_seqlens[1:][r.rows] - 1
    if pad is not None:
        _pad(v, m, r.num_tokens, pad, block_size)
    if prev_len is None:
        prev_len = pending.token_ids.numel() if pending is not None else 0
    v.id_sources[:] = np.arange(prev_len, prev_len + t)
    for at, req in r.pending:  # its id is the previous step's sampled token, still on the device
        if pending is None or req not in pending.rows:
            raise RuntimeError(f"request {req.request_id}: a scheduled token's id is not known")
        v.id_sources[at] = pending.rows[req]
    return StepInputs(flat, layout, r.real_q, [c - q + k for c, q, k in zip(r.ctx, r.q, r.real_q)], r.rows,
                      bool(r.pending), spec, real_tokens, sample_tokens)


def _pad(v: StepViews, m: int, num_tokens: int, pad: Padding, block_size: int) -> None:
    """Rows m.. of a step whose rows all hold pad.tokens tokens: token 0 at positions 0..tokens-1 of the
    scratch page, from a zero state in the scratch slot (a verify row's every column)."""
    q, n = pad.tokens, pad.rows
    if q > block_size:
        raise ValueError(f"padding rows of {q} tokens do not fit one scratch page of {block_size}")
    if n == m:  # no rows to add (a full ladder size: 37 µs of numpy calls on nothing)
        return
    v.context_lens[m:], v.state_slots[m:], v.fresh_state[m:] = q, pad.scratch_slot, True
    v.input_ids[num_tokens:] = 0
    v.positions[num_tokens:] = np.tile(np.arange(q), n - m)
    v.slot_mapping[num_tokens:] = pad.scratch_block * block_size + v.positions[num_tokens:]
    v.cu_seqlens[m + 1 :] = num_tokens + q * np.arange(1, n - m + 1)
    v.block_tables[m:, 0] = pad.scratch_block
    if pad.spec_width:
        v.spec_slots[m:], v.spec_src[m:] = pad.scratch_slot, 0
