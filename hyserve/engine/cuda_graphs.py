"""CUDA graphs for decode steps (DESIGN.md §6): one graph per batch size of a ladder, replayed over
static input buffers that each step overwrites in place.

A graph bakes in the tensors and the host values its forward saw at capture. So every tensor of the
`Batch` (including the lazily built `context_lens_device`) is a view of a buffer below, and the host
lists are fixed at capture: query lens all 1, and context lens all `max_model_len`, so any host-side
size derived from them (the split-K plan of the MLA decode kernel, the DSA index width) covers every
real context; the kernels read the real per-row lengths from the device buffer. A step of n sequences
replays the smallest size >= n; its padding rows decode token 0 at position 0 into the scratch page
and scratch state slot the cache manager keeps out of every pool, so they never touch a real one.

The inputs of a step reach the device in one host-to-device copy (see `DecodeGraphs` for the layout),
and the token ids that are still on the device (async scheduling) in one device-to-device copy; the
graph itself picks each row's id from the two.

On the CPU there is nothing to capture: the same buffers and padding run the forward directly (with the
step's real host context lens), which lets CPU tests check everything but the replay itself.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from hyserve.engine.kv_cache import KVCacheManager
from hyserve.models.batch import Batch, to_device
from hyserve.models.kimi import KimiForCausalLM

log = logging.getLogger(__name__)

MAX_GRAPH_BATCH = 512
_IDS, _POS, _CTX, _SLOT_MAP, _STATE_SLOT, _SRC = range(6)  # rows of a size's meta block
_META_ROWS = 6
# Block tables up to this many int64 entries ([size, max_blocks]) travel padded to the full width inside
# the one packed copy; wider ones (large batches of a long max_model_len: 512 x 2048 would be 8 MiB a
# step) travel as [size, width] plus a -1 fill of the rest, two more device ops but bounded bytes.
PACKED_TABLE_LIMIT = 1 << 15


def graph_batch_sizes(max_batch: int) -> list[int]:
    """vLLM's ladder: 1, 2, 4, then every multiple of 8, ending at min(max_batch, 512) itself."""
    cap = min(max_batch, MAX_GRAPH_BATCH)
    return [s for s in (1, 2, 4, *range(8, MAX_GRAPH_BATCH + 1, 8)) if s < cap] + [cap]


@dataclass(frozen=True)
class _Views:
    """One size's inputs inside a flat int64 region (the device buffer's, or a host staging copy of it)."""

    meta: torch.Tensor  # [6, size] long: ids, positions, context lens, slot mapping, state slots, id sources
    fresh: torch.Tensor  # [size] bool
    tables: torch.Tensor | None  # [size, max_blocks] long (-1 = unused); None: a staging copy without them


class DecodeGraphs:
    """The static inputs live in ONE int64 device buffer, `[prev tokens: P | region]`. The region holds a
    step of `size` rows as

        meta  [6, size] int64   ids, positions, context lens, slot mapping, state slots, id sources
        fresh [size] bool       bytes (the region's int64 words viewed as bool), padded to 8 bytes
        tables [size, max_blocks] int64, -1 past each row's blocks

    so everything the host knows about a step is one contiguous range that one non-blocking copy from a
    pinned staging tensor of the same layout fills. Each size lays its region out for itself (the
    layouts of different sizes overlap: a step rewrites all of its own); its views are made once, before
    capture, and the buffer is never reallocated, so every graph reads the views it was captured with.

    `fresh` is a bool view of bytes of the buffer rather than an int64 row: the KDA kernels read it as
    `!= 0`, but the torch reference layers use it as a `masked_fill` mask, which must be bool, and a
    conversion inside the graph would cost a kernel per step.

    Token ids: `prev` holds the previous step's sampled ids (async scheduling: copied device-to-device
    from the sampler's output before the step). Row i's id source is `P + i` (its id in the meta row, the
    host knew it) or the index of its token in `prev`; the graph gathers `buf[:P + size][sources]`, one
    kernel, so the pending ids need no host-to-device copies, gather or scatter of their own.
    """

    def __init__(self, model: KimiForCausalLM, kv: KVCacheManager, max_model_len: int, sizes: list[int],
                 max_prev_rows: int | None = None):
        """`max_prev_rows`: the most tokens a step samples (the longest `prev_tokens` of `run`); at
        least the largest size. A longer one still works, through a gather of the rows needed."""
        if kv.scratch_block is None or kv.scratch_slot is None:
            raise ValueError("decode graphs need a cache planned with a scratch page and slot")
        self.model, self.kv, self.max_model_len = model, kv, max_model_len
        self.sizes = sorted(sizes)
        self.max_blocks = -(-max_model_len // kv.block_size)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        n, dev = self.sizes[-1], model.device
        self._pin = dev.type == "cuda"
        p = max(n, max_prev_rows or 0)
        with torch.inference_mode():
            self._buf = torch.zeros(p + self._region_len(n, True), dtype=torch.long, device=dev)
            self._prev = self._buf[:p]
            self._views = {s: self._layout(self._buf[p:], s, True) for s in self.sizes}
            self.cu_seqlens = torch.arange(n + 1, dtype=torch.long, device=dev)
            self.logits = torch.zeros(n, model.config.vocab_size, dtype=torch.float32, device=dev)

    def _packs_tables(self, size: int) -> bool:
        return size * self.max_blocks <= PACKED_TABLE_LIMIT

    def _region_len(self, size: int, tables: bool) -> int:
        """int64 words of a size's region: meta, fresh bytes rounded up to words, then the tables."""
        return _META_ROWS * size + -(-size // 8) + (size * self.max_blocks if tables else 0)

    def _layout(self, flat: torch.Tensor, size: int, tables: bool) -> _Views:
        m, f = _META_ROWS * size, -(-size // 8)
        return _Views(
            meta=flat[:m].view(_META_ROWS, size),
            fresh=flat[m : m + f].view(torch.bool)[:size],
            tables=flat[m + f : m + f + size * self.max_blocks].view(size, self.max_blocks) if tables else None,
        )

    def size_for(self, n: int, max_table_len: int) -> int | None:
        """The ladder size a step of n one-token sequences replays, or None (the step runs eagerly)."""
        if n > self.sizes[-1] or max_table_len > self.max_blocks:
            return None
        size = next(s for s in self.sizes if s >= n)
        if self.model.device.type == "cuda" and size not in self.graphs:
            return None  # not captured (yet): the unpadded eager step is cheaper than a padded one
        return size

    @torch.inference_mode()
    def run(
        self, token_ids: list[int], context_lens: list[int], block_tables: list[list[int]],
        state_slots: list[int], fresh_state: list[bool],
        prev_tokens: torch.Tensor | None = None, token_src: list[int] | None = None,
    ) -> torch.Tensor:
        """Decode one token for each row; returns logits [n, V], a view valid until the next call.
        `prev_tokens` [M] on the device and `token_src` [n]: row i's token id is `prev_tokens[token_src[i]]`
        where that is >= 0 (sampled by the step before and not read back, async scheduling), else
        `token_ids[i]`."""
        n, bs = len(token_ids), self.kv.block_size
        width = max(map(len, block_tables))
        size = self.size_for(n, width)
        assert size is not None, "run() is only called for steps that size_for() accepts"
        pad, p = size - n, self._prev.numel()
        ctx = context_lens + [1] * pad
        pos = [c - 1 for c in ctx]
        slot_map = [t[q // bs] * bs + q % bs for t, q in zip(block_tables, pos)] + [self.kv.scratch_block * bs] * pad
        src = list(range(p, p + size))  # every id from the meta row
        if token_src is not None and prev_tokens is not None:
            if prev_tokens.numel() > p:
                prev_tokens, token_src = _compact(prev_tokens, token_src)
            src[:n] = [j if j >= 0 else p + i for i, j in enumerate(token_src)]
            # stream-ordered behind the sampler that wrote them and the replay before, which read prev
            self._prev[: prev_tokens.numel()].copy_(prev_tokens)
        packed = self._packs_tables(size)
        staging = torch.empty(self._region_len(size, packed), dtype=torch.long, pin_memory=self._pin)
        host = self._layout(staging, size, packed)
        host.meta.copy_(torch.tensor(
            [token_ids + [0] * pad, pos, ctx, slot_map, state_slots + [self.kv.scratch_slot] * pad, src]
        ))
        host.fresh.copy_(torch.tensor(fresh_state + [True] * pad))
        # non-blocking: a blocking copy would wait for the step still running (async scheduling). A new
        # pinned tensor each step: torch's pinned-memory cache keeps it until this copy is done, so the
        # next step cannot overwrite it while it is in flight (models/batch.py: staged()).
        region = self._buf[p : p + staging.numel()]
        dev_views = self._views[size]
        if packed:
            self._fill_tables(host.tables, block_tables)  # full width: -1 also past the widest row
        region.copy_(staging, non_blocking=True)
        if not packed:
            tables = torch.empty((size, width), dtype=torch.long, pin_memory=self._pin)
            self._fill_tables(tables, block_tables)
            dev_views.tables[:, :width].copy_(tables, non_blocking=True)
            dev_views.tables[:, width:].fill_(-1)  # what a wider table of an earlier step left behind
        graph = self.graphs.get(size)
        if graph is not None:
            graph.replay()
        else:
            self._step(self._batch(size, ctx))
        return self.logits[:n]

    def _fill_tables(self, out: torch.Tensor, block_tables: list[list[int]]) -> None:
        """out [size, w]: the rows' block tables, -1 past each row's blocks; padding rows hold the scratch
        page. One scatter of the flattened ids: a per-row copy costs a few microseconds of host time each."""
        lens = torch.tensor([len(t) for t in block_tables], dtype=torch.long)
        flat = torch.tensor([b for t in block_tables for b in t], dtype=torch.long)
        rows = torch.repeat_interleave(torch.arange(len(block_tables)), lens)
        cols = torch.arange(flat.numel()) - torch.repeat_interleave(torch.cumsum(lens, 0) - lens, lens)
        out.fill_(-1)
        out[rows, cols] = flat
        out[len(block_tables) :, 0] = self.kv.scratch_block

    def _batch(self, size: int, host_context_lens: list[int]) -> Batch:
        v = self._views[size]
        batch = Batch(
            query_lens=[1] * size, context_lens=host_context_lens, cu_seqlens=self.cu_seqlens[: size + 1],
            positions=v.meta[_POS], block_tables=v.tables, slot_mapping=v.meta[_SLOT_MAP],
            state_slots=v.meta[_STATE_SLOT], fresh_state=v.fresh,
        )
        # a cached property would be built once from the capture-time host list: point it at the buffer
        batch.context_lens_device = v.meta[_CTX]
        return batch

    def _step(self, batch: Batch) -> None:
        size = batch.num_seqs
        # each row's id: from the meta row (buffer index prev + i) or from the previous step's tokens
        pool = self._buf[: self._prev.numel() + size]
        ids = torch.index_select(pool, 0, self._views[size].meta[_SRC])
        hidden = self.model(ids, batch, self.kv.tensors)
        self.model.compute_logits(hidden, out=self.logits[:size])

    def _pad_all(self, size: int) -> None:
        """Every row a padding row: warm-up and capture runs write only the scratch page and slot."""
        v = self._views[size]
        v.meta.zero_()
        v.meta[_CTX] = 1
        v.meta[_SLOT_MAP] = self.kv.scratch_block * self.kv.block_size
        v.meta[_STATE_SLOT] = self.kv.scratch_slot
        v.meta[_SRC] = torch.arange(size, device=v.meta.device) + self._prev.numel()
        v.fresh.fill_(True)
        v.tables.fill_(-1)
        v.tables[:, 0] = self.kv.scratch_block

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every ladder size on CUDA (largest first, so the smaller graphs reuse its memory from
        the shared pool). A size whose forward synchronises with the host (a torch reference op, the
        sorted-MoE path of float32 weights at a large batch) cannot be captured: it is left out, and
        steps of that size run eagerly."""
        if self.model.device.type != "cuda":
            return
        t0, pool, skipped = time.perf_counter(), torch.cuda.graph_pool_handle(), []
        for size in reversed(self.sizes):
            batch = self._batch(size, [self.max_model_len] * size)
            self._pad_all(size)
            # Triton compiles and lazily built tensors (merged weights, rope tables) happen here,
            # outside the graph, on a side stream as torch.cuda.graph expects
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    self._step(batch)
            torch.cuda.current_stream().wait_stream(side)
            try:
                # a host sync would abort the capture, possibly leaving the CUDA context unusable;
                # one eager run with syncs made errors finds such sizes first
                torch.cuda.set_sync_debug_mode("error")
                try:
                    self._step(batch)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._step(batch)
            except RuntimeError as e:  # also an out-of-memory error: the smaller sizes may still fit
                skipped.append(size)
                log.warning("decode batch %d runs without a CUDA graph: %s", size, str(e).splitlines()[0][:200])
                continue
            self.graphs[size] = graph
        torch.cuda.synchronize()
        log.info(
            "captured %d CUDA graphs for decode batch sizes %s in %.1f s%s", len(self.graphs),
            sorted(self.graphs), time.perf_counter() - t0, f" (eager: {sorted(skipped)})" if skipped else "",
        )


def _compact(prev_tokens: torch.Tensor, token_src: list[int]) -> tuple[torch.Tensor, list[int]]:
    """More previous tokens than the buffer holds (a step sampled more rows than `max_prev_rows`): only
    the ones this step reads, gathered, and the sources renumbered to them."""
    needed = sorted({j for j in token_src if j >= 0})
    at = {j: k for k, j in enumerate(needed)}
    return prev_tokens[to_device(needed, torch.long, prev_tokens.device)], [at.get(j, -1) for j in token_src]
