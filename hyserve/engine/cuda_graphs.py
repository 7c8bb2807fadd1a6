"""CUDA graphs for decode steps (DESIGN.md §6): one graph per batch size of a ladder, replayed over
static input buffers that each step overwrites in place.

A graph bakes in the tensors and the host values its forward saw at capture. So every tensor of the
`Batch` (including the lazily built `context_lens_device`) is a view of a buffer below, and the host
lists are fixed at capture: query lens all 1, and context lens all `max_model_len`, so any host-side
size derived from them (the split-K plan of the MLA decode kernel, the DSA index width) covers every
real context; the kernels read the real per-row lengths from the device buffer. A step of n sequences
replays the smallest size >= n; its padding rows decode token 0 at position 0 into the scratch page
and scratch state slot the cache manager keeps out of every pool, so they never touch a real one.

On the CPU there is nothing to capture: the same buffers and padding run the forward directly (with the
step's real host context lens), which lets CPU tests check everything but the replay itself.
"""

from __future__ import annotations

import itertools
import logging
import time

import torch

from hyserve.engine.kv_cache import KVCacheManager
from hyserve.models.batch import Batch, staged
from hyserve.models.kimi import KimiForCausalLM

log = logging.getLogger(__name__)

MAX_GRAPH_BATCH = 512
_IDS, _POS, _CTX, _SLOT_MAP, _STATE_SLOT = range(5)  # rows of DecodeGraphs.meta


def graph_batch_sizes(max_batch: int) -> list[int]:
    """vLLM's ladder: 1, 2, 4, then every multiple of 8, ending at min(max_batch, 512) itself."""
    cap = min(max_batch, MAX_GRAPH_BATCH)
    return [s for s in (1, 2, 4, *range(8, MAX_GRAPH_BATCH + 1, 8)) if s < cap] + [cap]


class DecodeGraphs:
    def __init__(self, model: KimiForCausalLM, kv: KVCacheManager, max_model_len: int, sizes: list[int]):
        if kv.scratch_block is None or kv.scratch_slot is None:
            raise ValueError("decode graphs need a cache planned with a scratch page and slot")
        self.model, self.kv, self.max_model_len = model, kv, max_model_len
        self.sizes = sorted(sizes)
        self.max_blocks = -(-max_model_len // kv.block_size)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        n, dev = self.sizes[-1], model.device
        with torch.inference_mode():
            # one int64 block for the per-row values, so a step moves them with one host-to-device copy
            self.meta = torch.zeros(5, n, dtype=torch.long, device=dev)
            self.fresh = torch.ones(n, dtype=torch.bool, device=dev)
            self.block_tables = torch.full((n, self.max_blocks), -1, dtype=torch.long, device=dev)
            self.cu_seqlens = torch.arange(n + 1, dtype=torch.long, device=dev)
            self.logits = torch.zeros(n, model.config.vocab_size, dtype=torch.float32, device=dev)

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
        device_tokens: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Decode one token for each row; returns logits [n, V], a view valid until the next call.
        `device_tokens` (rows, ids), both on the device: those rows' token ids are still there (sampled
        by the step before, async scheduling) and replace the placeholders in token_ids."""
        n, bs = len(token_ids), self.kv.block_size
        width = max(map(len, block_tables))
        size = self.size_for(n, width)
        assert size is not None, "run() is only called for steps that size_for() accepts"
        pad = size - n
        ctx = context_lens + [1] * pad
        pos = [c - 1 for c in ctx]
        slot_map = [t[p // bs] * bs + p % bs for t, p in zip(block_tables, pos)] + [self.kv.scratch_block * bs] * pad
        # non-blocking: a blocking copy would wait for the step still running (async scheduling)
        dev = self.meta.device
        self.meta[:, :size].copy_(staged(torch.tensor(
            [token_ids + [0] * pad, pos, ctx, slot_map, state_slots + [self.kv.scratch_slot] * pad]
        ), dev), non_blocking=True)
        if device_tokens is not None:
            self.meta[_IDS].index_copy_(0, *device_tokens)
        self.fresh[:size].copy_(staged(torch.tensor(fresh_state + [True] * pad), dev), non_blocking=True)
        self.block_tables[:size, :width].copy_(staged(self._host_tables(block_tables, size, width), dev),
                                               non_blocking=True)
        self.block_tables[:size, width:].fill_(-1)  # what a shorter table of an earlier step left behind
        graph = self.graphs.get(size)
        if graph is not None:
            graph.replay()
        else:
            self._step(self._batch(size, ctx))
        return self.logits[:n]

    def _host_tables(self, block_tables: list[list[int]], size: int, width: int) -> torch.Tensor:
        """[size, width] block tables, -1 past each row's blocks; padding rows hold the scratch page.
        One scatter of the flattened ids: a per-row copy costs a few microseconds of host time each."""
        lens = torch.tensor([len(t) for t in block_tables], dtype=torch.long)
        flat = torch.tensor(list(itertools.chain.from_iterable(block_tables)), dtype=torch.long)
        rows = torch.repeat_interleave(torch.arange(len(block_tables)), lens)
        cols = torch.arange(flat.numel()) - torch.repeat_interleave(torch.cumsum(lens, 0) - lens, lens)
        tables = torch.full((size, width), -1, dtype=torch.long)
        tables[rows, cols] = flat
        tables[len(block_tables) :, 0] = self.kv.scratch_block
        return tables

    def _batch(self, size: int, host_context_lens: list[int]) -> Batch:
        batch = Batch(
            query_lens=[1] * size, context_lens=host_context_lens, cu_seqlens=self.cu_seqlens[: size + 1],
            positions=self.meta[_POS, :size], block_tables=self.block_tables[:size],
            slot_mapping=self.meta[_SLOT_MAP, :size], state_slots=self.meta[_STATE_SLOT, :size],
            fresh_state=self.fresh[:size],
        )
        # a cached property would be built once from the capture-time host list: point it at the buffer
        batch.context_lens_device = self.meta[_CTX, :size]
        return batch

    def _step(self, batch: Batch) -> None:
        size = batch.num_seqs
        hidden = self.model(self.meta[_IDS, :size], batch, self.kv.tensors)
        self.model.compute_logits(hidden, out=self.logits[:size])

    def _pad_all(self, size: int) -> None:
        """Every row a padding row: warm-up and capture runs write only the scratch page and slot."""
        self.meta[:, :size] = 0
        self.meta[_CTX, :size] = 1
        self.meta[_SLOT_MAP, :size] = self.kv.scratch_block * self.kv.block_size
        self.meta[_STATE_SLOT, :size] = self.kv.scratch_slot
        self.fresh[:size] = True
        self.block_tables[:size] = -1
        self.block_tables[:size, 0] = self.kv.scratch_block

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
