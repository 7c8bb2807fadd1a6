"""What one forward step sees: the flattened token batch and the cache tensors (docs/ARCHITECTURE.md §4.1, §5).

Layers never see requests or HF cache objects. A step is `T` tokens of `N` sequences laid end to end;
sequence i owns tokens `cu_seqlens[i]:cu_seqlens[i+1]`, which are its positions
`context_lens[i] - query_lens[i] ... context_lens[i] - 1`.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, field

import torch

from hyserve.ops.mla_attention import paged_rows


def staged(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """t in pinned memory when it is bound for a CUDA device. A copy from pageable memory can block the
    host until the stream drains; from pinned memory `non_blocking=True` only queues it, and torch's
    pinned-memory cache keeps the block until that copy is done."""
    return t.pin_memory() if torch.device(device).type == "cuda" else t


def host_to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """t on device without waiting for the stream."""
    return staged(t, device).to(device, non_blocking=True)


def to_device(values, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """torch.tensor(values) on device without a stream sync (torch.tensor(..., device="cuda") copies
    blocking, which waits for every queued kernel: the host could not prepare step k+1 while the GPU
    runs step k)."""
    return host_to_device(torch.tensor(values, dtype=dtype), device)


@dataclass
class CacheTensors:
    """The two pools. `pages[b, l]` is block b's page of full-attention layer l ([block_size, row]);
    one row per block packs every MLA layer. `conv[s, l]` / `recurrent[s, l]` are state slot s of KDA
    layer l: the last W-1 pre-conv q/k/v inputs (oldest first) and the fp32 [H, V, K] matrix.
    `index_keys[b, l]` (models with a DSA indexer) holds the same block's index-key records of MLA layer
    l as bytes: 132 per token for FP8, 68 for MXFP4, each page split into its tokens' value parts then
    their scale parts (ops/dsa_indexer.py), so a block id still covers everything one block of tokens
    needs."""

    pages: torch.Tensor  # [num_blocks, n_mla, block_size, row_width]
    conv: torch.Tensor  # [num_slots, n_kda, 3P, W-1]
    recurrent: torch.Tensor  # [num_slots, n_kda, H, V, K] fp32
    index_keys: torch.Tensor | None = None  # [num_blocks, n_mla, block_size, key_bytes] uint8

    @property
    def block_size(self) -> int:
        return self.pages.shape[2]

    @property
    def block_tensors(self) -> list[torch.Tensor]:
        """Every tensor a block id indexes: the MLA rows and, with a DSA indexer, the index keys."""
        return [self.pages] if self.index_keys is None else [self.pages, self.index_keys]

    def copy_slots(self, src: list[int], dst: list[int]) -> None:
        """State slot dst[i] becomes a copy of slot src[i] (conv tail and recurrent matrix), without a
        stream sync. The cache manager's copies go through here and `copy_blocks`, so that under a
        parallel layout they can be applied by every rank to its own tensors (distributed/executor.py)."""
        s, d = (to_device(x, torch.long, self.conv.device) for x in (src, dst))
        self.conv.index_copy_(0, d, self.conv.index_select(0, s))
        self.recurrent.index_copy_(0, d, self.recurrent.index_select(0, s))

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Block dst[i] becomes a copy of block src[i] in every per-block tensor."""
        s, d = (to_device(x, torch.long, self.pages.device) for x in (src, dst))
        for t in self.block_tensors:
            t.index_copy_(0, d, t.index_select(0, s))


@dataclass
class VerifyRows:
    """The verify sequences of a speculative step (docs/speculative_decoding.md): KDA layers run them
    through ops/kda_verify.py, from the state in column `src` of their slot row, the state after each token
    into its own column."""

    seqs: list[int]  # indices of the verify sequences among the step's
    slot_table: torch.Tensor  # [Nv, 1+K] long
    src: torch.Tensor  # [Nv] long


@dataclass
class VerifyGroup:
    """The verify sequences of one query length: what one `kda_verify_multi` call takes (it needs the same
    number of tokens for every sequence)."""

    tokens: int  # 1 + k of every sequence in the group
    rows: torch.Tensor  # [n * tokens] long: the step's token rows, sequence-major
    slot_table: torch.Tensor  # [n, 1+K] long: the sequences' rows of VerifyRows.slot_table
    src: torch.Tensor  # [n] long
    whole_step: bool = False  # the rows are every token of the step, in order: no gather, no scatter


@dataclass
class DecodeRows:
    """The MLA query rows a step sends to the decode kernel: its plain decodes, and every token of its verify
    rows as a one-token query over the positions up to its own (token j of a row of n over a context of c
    sees c - n + 1 + j positions: the causal mask as a context length). A verified token is then computed
    by the kernel that computes it in a plain decode step, and no cached row is expanded to K/V."""

    tokens: torch.Tensor  # [R] long: the rows' tokens among the step's, in token order
    seqs: torch.Tensor  # [R] long: each row's sequence (its block-table row)
    context_lens: torch.Tensor  # [R] long
    max_context: int
    whole_step: bool  # the rows are every token of the step (no prefill chunk): no gather, no scatter


@dataclass
class PrefillRows:
    """A step's prefill chunks as every KDA and MLA layer indexes them, built once per step: each layer
    building its own cost a host-to-device copy and a dozen small kernels a layer (20 KDA and 7 MLA
    layers in a 48B step)."""

    seqs: list[int]  # the chunks' sequences among the step's (`Batch.prefill_seqs`)
    cu_host: torch.Tensor  # [Np+1] long on the host: the chunks laid end to end
    cu: torch.Tensor  # the same on the device (fla caches what it derives from it by tensor identity)
    tokens: slice | torch.Tensor  # the chunks' rows among the step's: a slice when they are one run
    whole_step: bool  # the chunks are every token of the step: no gather, no scatter
    slots: torch.Tensor  # [Np] long: their KDA state slots
    fresh: torch.Tensor  # [Np] bool
    seq_of_token: torch.Tensor  # [Tp] int32: each chunk token's chunk (the conv kernel's map)
    context_lens: list[int]
    _memo: dict = field(default_factory=dict, repr=False)

    @property
    def num_tokens(self) -> int:
        return int(self.cu_host[-1])

    def memo(self, key, build):
        """build() once per step under key: what a layer derives from these rows for every layer."""
        if key not in self._memo:
            self._memo[key] = build()
        return self._memo[key]

    def context_rows(self, block_tables: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(page, row in the page) of every cached position of every chunk's sequence, sequence after
        sequence: the rows the MLA prefill expands, the same in every MLA layer."""
        return self.memo(("context", block_size), lambda: self._context_rows(block_tables, block_size))

    def _context_rows(self, block_tables: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        bt = block_tables if self.whole_step else block_tables[to_device(self.seqs, torch.long, self.cu.device)]
        return paged_rows(bt, self.context_lens, block_size)


def chunk_rows(cu: list[int], seqs: list[int]) -> slice | torch.Tensor:
    """The token rows of sequences `seqs` (ascending) of a step with host cu_seqlens `cu`: a slice when
    they are consecutive, an index on the host otherwise."""
    if all(b == a + 1 for a, b in zip(seqs, seqs[1:])):
        return slice(cu[seqs[0]], cu[seqs[-1] + 1])
    return torch.cat([torch.arange(cu[i], cu[i + 1]) for i in seqs])


@dataclass
class Batch:
    query_lens: list[int]
    context_lens: list[int]  # tokens of the sequence in the cache after this step
    cu_seqlens: torch.Tensor  # [N+1] long
    positions: torch.Tensor  # [T] long
    block_tables: torch.Tensor  # [N, max_blocks] long (-1 = unused)
    slot_mapping: torch.Tensor  # [T] long: block * block_size + offset of each new token
    state_slots: torch.Tensor  # [N] long
    fresh_state: torch.Tensor  # [N] bool: start from a zero KDA state (slot contents ignored)
    # context_lens on the device, built once per step (GPU kernels read it; every MLA layer building its
    # own would cost a host-to-device copy per layer)
    context_lens_device: torch.Tensor  # [N] long
    verify: VerifyRows | None = None  # speculative steps only

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return int(sum(self.query_lens))

    @functools.cached_property
    def cu_seqlens_host(self) -> list[int]:
        """cu_seqlens as host ints, from query_lens: reading the device tensor back would sync the stream."""
        return [0, *itertools.accumulate(self.query_lens)]

    @functools.cached_property
    def prefill_seqs(self) -> list[int]:
        """The sequences with more than one new token that are not verify rows (prompt chunks)."""
        verify = set(self.verify.seqs) if self.verify is not None else set()
        return [i for i, n in enumerate(self.query_lens) if n > 1 and i not in verify]

    @functools.cached_property
    def verify_lens(self) -> list[int]:
        """Each verify sequence's query length (1 + its drafts), host ints."""
        return [self.query_lens[i] for i in self.verify.seqs] if self.verify is not None else []

    @functools.cached_property
    def verify_groups(self) -> list[VerifyGroup]:
        """The verify sequences grouped by query length, built once per step for every KDA layer (index
        tensors from host values, copied to the device without a read-back)."""
        if self.verify is None:
            return []
        cu, seqs, groups = self.cu_seqlens_host, self.verify.seqs, []
        dev = self.cu_seqlens.device
        for t in sorted(set(self.verify_lens)):
            members = [j for j, n in enumerate(self.verify_lens) if n == t]
            rows = to_device([r for j in members for r in range(cu[seqs[j]], cu[seqs[j]] + t)], torch.long, dev)
            if len(members) == len(seqs):  # one length: the step's own tensors, no gather
                whole = list(seqs) == list(range(self.num_seqs))  # verify rows only, sequence after sequence
                groups.append(VerifyGroup(t, rows, self.verify.slot_table, self.verify.src, whole))
                continue
            idx = to_device(members, torch.long, dev)
            groups.append(VerifyGroup(t, rows, self.verify.slot_table[idx], self.verify.src[idx]))
        return groups

    @functools.cached_property
    def decode_rows(self) -> DecodeRows | None:
        """The step's `DecodeRows` (None without decodes or verify rows), from host values in one copy."""
        pre = set(self.prefill_seqs)  # every other sequence is a plain decode or a verify row
        cu, tok, seq, ctx = self.cu_seqlens_host, [], [], []
        for i, (n, c) in enumerate(zip(self.query_lens, self.context_lens)):
            if i not in pre:
                tok += range(cu[i], cu[i] + n)
                seq += [i] * n
                ctx += range(c - n + 1, c + 1)
        if not tok:
            return None
        packed = to_device([tok, seq, ctx], torch.long, self.cu_seqlens.device)
        return DecodeRows(packed[0], packed[1], packed[2], max(ctx), len(tok) == cu[-1])

    @functools.cached_property
    def prefill_rows(self) -> PrefillRows | None:
        """The step's `PrefillRows` (None without prefill chunks). One cu_seqlens tensor for every KDA
        layer: fla caches the chunk indices it derives from it by tensor identity, and a new tensor per
        layer made it rebuild them with a blocking copy, a host sync per layer."""
        pre = self.prefill_seqs
        if not pre:
            return None
        dev = self.cu_seqlens.device
        lens = [self.query_lens[i] for i in pre]
        cu_host = torch.tensor([0, *lens], dtype=torch.long).cumsum(0)
        whole = len(pre) == self.num_seqs
        tokens, slots, fresh = slice(None), self.state_slots, self.fresh_state
        if not whole:
            tokens = chunk_rows(self.cu_seqlens_host, pre)
            if isinstance(tokens, torch.Tensor):
                tokens = host_to_device(tokens, dev)
            idx = to_device(pre, torch.long, dev)
            slots, fresh = slots[idx], fresh[idx]
        seq_of_token = torch.repeat_interleave(torch.arange(len(pre), dtype=torch.int32), torch.tensor(lens),
                                               output_size=sum(lens))
        return PrefillRows(pre, cu_host, host_to_device(cu_host, dev), tokens, whole, slots, fresh,
                           host_to_device(seq_of_token, dev), [self.context_lens[i] for i in pre])

    @property
    def decode_only(self) -> bool:
        return all(q == 1 for q in self.query_lens)

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        state_slots: list[int],
        fresh_state: list[bool],
        device: torch.device | str = "cpu",
    ) -> Batch:
        """Vectorised construction from per-sequence lists (no per-token Python loops)."""
        q = torch.tensor(query_lens, dtype=torch.long)
        ctx = torch.tensor(context_lens, dtype=torch.long)
        cu = torch.zeros(len(query_lens) + 1, dtype=torch.long)
        cu[1:] = torch.cumsum(q, 0)
        seq_of_token = torch.repeat_interleave(torch.arange(len(query_lens)), q)
        start = (ctx - q)[seq_of_token]
        positions = start + torch.arange(int(cu[-1])) - cu[:-1][seq_of_token]
        width = max((len(b) for b in block_tables), default=0) or 1
        bt = torch.full((len(block_tables), width), -1, dtype=torch.long)
        for i, blocks in enumerate(block_tables):
            if blocks:
                bt[i, : len(blocks)] = torch.as_tensor(blocks, dtype=torch.long)
        slot_mapping = bt[seq_of_token, positions // block_size] * block_size + positions % block_size
        dev = torch.device(device)
        return cls(
            query_lens=list(query_lens),
            context_lens=list(context_lens),
            cu_seqlens=host_to_device(cu, dev),
            positions=host_to_device(positions, dev),
            block_tables=host_to_device(bt, dev),
            slot_mapping=host_to_device(slot_mapping, dev),
            state_slots=to_device(state_slots, torch.long, dev),
            fresh_state=to_device(fresh_state, torch.bool, dev),
            context_lens_device=host_to_device(ctx, dev),
        )
