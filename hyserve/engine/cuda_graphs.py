"""CUDA graphs for decode steps (docs/ARCHITECTURE.md, "CUDA graphs"): one graph per batch size of a
ladder, replayed over static input buffers that each step overwrites in place.

A graph bakes in the tensors and the host values its forward saw at capture. So every tensor of the
`Batch` is a view of the buffer below, and the host lists are fixed at capture: query lens all 1, and
context lens all `max_model_len`, so any host-side size derived from them (the split-K plan of the MLA
decode kernel, the DSA index width) covers every real context; the kernels read the real per-row
lengths from the device buffer. A step of n sequences replays the smallest size >= n; its padding rows
decode token 0 at position 0 into the scratch page and scratch state slot the cache manager keeps out
of every pool, so they never touch a real one.

The inputs of a step are built once (engine/step_inputs.py) in the layout of the size's static region
and reach the device in one host-to-device copy; the token ids that are still on the device (async
scheduling) come in one device-to-device copy, and the graph itself picks each row's id from the two.

On the CPU there is nothing to capture: the same buffers and padding run the forward directly (with the
step's real host context lens), which lets CPU tests check everything but the replay itself.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import torch

from hyserve.engine.kv_cache import KVCacheManager
from hyserve.engine.step_inputs import Padding, StepInputs, StepLayout, build_step_inputs
from hyserve.models.kimi import KimiForCausalLM

log = logging.getLogger(__name__)

MAX_GRAPH_BATCH = 512
# Block tables up to this many int64 entries ([size, max_blocks]) travel padded to the full width inside
# the one packed copy; wider ones (large batches of a long max_model_len: 512 x 2048 would be 8 MiB a
# step) travel as [size, width] plus a -1 fill of the rest, two more device ops but bounded bytes.
PACKED_TABLE_LIMIT = 1 << 15


def graph_batch_sizes(max_batch: int) -> list[int]:
    """vLLM's ladder: 1, 2, 4, then every multiple of 8, ending at min(max_batch, 512) itself."""
    cap = min(max_batch, MAX_GRAPH_BATCH)
    return [s for s in (1, 2, 4, *range(8, MAX_GRAPH_BATCH + 1, 8)) if s < cap] + [cap]


class DecodeGraphs:
    """The static inputs live in ONE int64 device buffer, `[prev tokens: P | region]`. A size's region is
    the step-input layout of `size` rows at the full table width (`StepLayout(size, size, 0, max_blocks)`),
    so everything the host knows about a step is one contiguous range that one non-blocking copy of the
    step's pinned input buffer fills. Each size lays its region out for itself (the layouts of different
    sizes overlap: a step rewrites all of its own); its views and its `Batch` are made once, before
    capture, and the buffer is never reallocated, so every graph reads the views it was captured with.

    Token ids: `prev` holds the previous step's sampled ids (async scheduling: copied device-to-device
    from the sampler's output before the step). Row i's id source is `P + i` (its id in the ids row, the
    host knew it) or the index of its token in `prev`; the graph gathers `buf[:P + size][sources]`, one
    kernel, so the pending ids need no host-to-device copies, gather or scatter of their own.
    """

    def __init__(self, model: KimiForCausalLM, kv: KVCacheManager, max_model_len: int, sizes: list[int],
                 max_prev_rows: int | None = None):
        """`max_prev_rows`: the most tokens a step samples (the longest `prev_tokens` of `run`); at
        least the largest size."""
        if kv.scratch_block is None or kv.scratch_slot is None:
            raise ValueError("decode graphs need a cache planned with a scratch page and slot")
        self.model, self.kv, self.max_model_len = model, kv, max_model_len
        self.sizes = sorted(sizes)
        self.max_blocks = -(-max_model_len // kv.block_size)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        n, dev = self.sizes[-1], model.device
        p = max(n, max_prev_rows or 0)
        self.max_prev = p = p + (p & 1)  # even: the region's rows stay 16-byte aligned (see StepLayout)
        with torch.inference_mode():
            self._buf = torch.zeros(p + StepLayout(n, n, 0, self.max_blocks).words, dtype=torch.long, device=dev)
            self._prev = self._buf[:p]
            self._views = {s: StepLayout(s, s, 0, self.max_blocks).views(self._buf[p:]) for s in self.sizes}
            self._batches = {s: v.batch([1] * s, [max_model_len] * s) for s, v in self._views.items()}
            self.logits = torch.zeros(n, model.config.vocab_size, dtype=torch.float32, device=dev)

    def table_width(self, size: int, longest: int) -> int:
        """The block-table columns a step of `size` rows travels with (`longest`: its longest table)."""
        return self.max_blocks if size * self.max_blocks <= PACKED_TABLE_LIMIT else longest

    def size_for(self, n: int, max_table_len: int) -> int | None:
        """The ladder size a step of n one-token sequences replays, or None (the step runs eagerly)."""
        if n > self.sizes[-1] or max_table_len > self.max_blocks:
            return None
        size = next(s for s in self.sizes if s >= n)
        if self.model.device.type == "cuda" and size not in self.graphs:
            return None  # not captured (yet): the unpadded eager step is cheaper than a padded one
        return size

    @torch.inference_mode()
    def run(self, inputs: StepInputs, prev_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Decode one token for each row of `inputs` (built padded to a ladder size with prev_len
        `max_prev`, see ModelRunner); returns logits [n, V], a view valid until the next call.
        `prev_tokens` [<= max_prev] on the device: the ids the rows' sources point into."""
        layout, p = inputs.layout, self.max_prev
        size, w, head = layout.num_seqs, layout.width, layout.table_offset
        if prev_tokens is not None:
            # stream-ordered behind the sampler that wrote them and the replay before, which read prev
            self._prev[: prev_tokens.numel()].copy_(prev_tokens)
        # non-blocking: a blocking copy would wait for the step still running (async scheduling). A new
        # pinned buffer each step: torch's pinned-memory cache keeps it until this copy is done, so the
        # next step cannot overwrite it while it is in flight (models/batch.py: staged()).
        if w == self.max_blocks:
            self._buf[p : p + layout.words].copy_(inputs.flat, non_blocking=True)
        else:
            tables = self._views[size].block_tables
            self._buf[p : p + head].copy_(inputs.flat[:head], non_blocking=True)
            tables[:, :w].copy_(inputs.flat[head : head + size * w].view(size, w), non_blocking=True)
            tables[:, w:].fill_(-1)  # what a wider table of an earlier step left behind
        graph = self.graphs.get(size)
        if graph is not None:
            graph.replay()
        else:
            pad = [1] * (size - len(inputs.context_lens))
            self._step(size, dataclasses.replace(self._batches[size], context_lens=inputs.context_lens + pad))
        return self.logits[: len(inputs.query_lens)]

    def _step(self, size: int, batch) -> None:
        # each row's id: from the ids row (buffer index prev + i) or from the previous step's tokens
        pool = self._buf[: self.max_prev + size]
        ids = torch.index_select(pool, 0, self._views[size].id_sources)
        hidden = self.model(ids, batch, self.kv.tensors)
        self.model.compute_logits(hidden, out=self.logits[:size])

    def _pad_all(self, size: int) -> None:
        """Every row a padding row: warm-up and capture runs write only the scratch page and slot."""
        kv = self.kv
        inputs = build_step_inputs([], kv.block_size, pad=Padding(size, kv.scratch_block, kv.scratch_slot),
                                   width=self.max_blocks, prev_len=self.max_prev, sampled=False)
        self._buf[self.max_prev : self.max_prev + inputs.layout.words].copy_(inputs.flat.to(self._buf.device))

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
            batch = self._batches[size]
            self._pad_all(size)
            # Triton compiles and lazily built tensors (merged weights, rope tables) happen here,
            # outside the graph, on a side stream as torch.cuda.graph expects
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    self._step(size, batch)
            torch.cuda.current_stream().wait_stream(side)
            try:
                # a host sync would abort the capture, possibly leaving the CUDA context unusable;
                # one eager run with syncs made errors finds such sizes first
                torch.cuda.set_sync_debug_mode("error")
                try:
                    self._step(size, batch)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._step(size, batch)
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
