"""CUDA graphs for decode steps (docs/ARCHITECTURE.md, "CUDA graphs"): one graph per batch size of a
ladder, replayed over static input buffers that each step overwrites in place; with speculative decoding
also one per (batch size, 1 + k) for steps of verify rows of at most k drafts and decodes.

A graph bakes in the tensors and the host values its forward saw at capture. So every tensor of the
`Batch` is a view of the buffer below, and the host lists are fixed at capture: query lens all 1, and
context lens all `max_model_len`, so any host-side size derived from them (the split-K plan of the MLA
decode kernel, the DSA index width) covers every real context; the kernels read the real per-row
lengths from the device buffer. A step of n sequences replays the smallest size >= n; its padding rows
decode token 0 at position 0 into the scratch page and scratch state slot the cache manager keeps out
of every pool, so they never touch a real one.

A verify graph (every row 1 + k tokens) is the same with query lens 1 + k: its MLA layers send each token
to the decode kernel as a one-token query over the positions up to its own (`DecodeRows`), whose context
lens the graph derives from the device's per-row lengths; its KDA layers run one verify-kernel call over
the static slot table. A step whose rows carry different draft counts, or decodes beside verify rows
(n-gram drafts that match for some requests only, a confidence cut), replays the graph of 1 + its most
drafts: each shorter row is followed by padding tokens that write only the scratch page, whose states
go to the row's own later columns (where rejected drafts' would) or, for a decode, to the scratch slot
while its own state is updated in place (step_inputs.VerifyInputs.of); only the real rows' logits and
features are gathered. Models with a DSA indexer have no verify graphs: the indexer plans verify rows
from host values.

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
from hyserve.models.batch import Batch, DecodeRows, VerifyGroup, VerifyRows
from hyserve.models.kimi import KimiForCausalLM
from hyserve.models.segment_graphs import capture_graph
from hyserve.spec_decode.target_features import tap_features

log = logging.getLogger(__name__)

MAX_GRAPH_BATCH = 512
# Block tables up to this many int64 entries ([size, max_blocks]) travel padded to the full width inside
# the one packed copy; wider ones (large batches of a long max_model_len: 512 x 2048 would be 8 MiB a
# step) travel as [size, width] plus a -1 fill of the rest, two more device ops but bounded bytes.
PACKED_TABLE_LIMIT = 1 << 15
# verify graphs (one ladder per draft count): a verify step is bound by its weight reads only while it is
# small, and past these the graphs' capture time and memory grow with every draft count
MAX_VERIFY_SEQS = 64
MAX_VERIFY_TOKENS = 256


def graph_batch_sizes(max_batch: int) -> list[int]:
    """vLLM's ladder: 1, 2, 4, then every multiple of 8, ending at min(max_batch, 512) itself."""
    cap = min(max_batch, MAX_GRAPH_BATCH)
    return [s for s in (1, 2, 4, *range(8, MAX_GRAPH_BATCH + 1, 8)) if s < cap] + [cap]


def verify_graph_sizes(spec, max_batch: int, block_size: int, dsa: bool = False) -> dict[int, list[int]]:
    """The verify graphs a speculative config gets: for each query length 2 .. 1 + k, the ladder of batch
    sizes up to the largest batch that still speculates (below disable_by_batch_size), MAX_VERIFY_SEQS and
    MAX_VERIFY_TOKENS tokens. None for a model with a DSA indexer (`dsa`: the indexer plans verify rows
    from host values)."""
    if spec is None or dsa:
        return {}
    cap = min(max_batch, MAX_VERIFY_SEQS, (spec.disable_by_batch_size or max_batch + 1) - 1)
    out = {}
    for q in range(2, min(spec.num_speculative_tokens + 1, block_size) + 1):  # a padding row fits one page
        n = min(cap, MAX_VERIFY_TOKENS // q)
        if n >= 1:
            out[q] = graph_batch_sizes(n)
    return out


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
                 max_prev_rows: int | None = None, verify: dict[int, list[int]] | None = None, spec_width: int = 0,
                 feature_layers: list[int] | None = None):
        """`max_prev_rows`: the most tokens a step samples (the longest `prev_tokens` of `run`); at
        least the largest size. `verify`: the batch sizes of each verify query length 1 + k; `spec_width`:
        the state-slot columns of a verify row (1 + the most drafts). `feature_layers`: each run also
        leaves the hidden states after these layers in `features` (a drafter's context, read by forward
        hooks at capture; the graph replays their copy into the static buffer)."""
        if kv.scratch_block is None or kv.scratch_slot is None:
            raise ValueError("decode graphs need a cache planned with a scratch page and slot")
        self.model, self.kv, self.max_model_len = model, kv, max_model_len
        self.sizes = sorted(sizes)
        self.verify_sizes = {q: sorted(v) for q, v in (verify or {}).items() if v}
        self.max_blocks = -(-max_model_len // kv.block_size)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}  # (batch size, tokens per row)
        self.last_key: tuple[int, int] | None = None  # the (size, tokens per row) the last `run` took
        keys = [(s, 1) for s in self.sizes] + [(s, q) for q, v in self.verify_sizes.items() for s in v]
        self._layouts = {(s, q): StepLayout(s * q, s, 0, self.max_blocks, spec_width if q > 1 else 0) for s, q in keys}
        dev, n = model.device, self.sizes[-1]
        p = max(n, max_prev_rows or 0)
        self.max_prev = p = p + (p & 1)  # even: the region's rows stay 16-byte aligned (see StepLayout)
        rows = max(s * q for s, q in keys)
        with torch.inference_mode():
            self._buf = torch.zeros(p + max(x.words for x in self._layouts.values()), dtype=torch.long, device=dev)
            self._prev = self._buf[:p]
            self._views = {k: x.views(self._buf[p:]) for k, x in self._layouts.items()}
            self._row_ctx = torch.zeros(rows, dtype=torch.long, device=dev)  # verify graphs' DecodeRows lens
            self._batches = {k: self._static_batch(*k) for k in keys}
            self.logits = torch.zeros(rows, model.config.vocab_size, dtype=torch.float32, device=dev)
            self.feature_layers = list(feature_layers or [])
            width = model.config.hidden_size * len(self.feature_layers)
            self.features = torch.zeros(rows if width else 0, width, dtype=model.dtype, device=dev)
        kv.tensors.conv[kv.scratch_slot].zero_()  # verify padding rows read the scratch state: keep it finite
        kv.tensors.recurrent[kv.scratch_slot].zero_()

    def _static_batch(self, size: int, q: int) -> Batch:
        """The `Batch` a graph of `size` rows of q tokens is captured with: views of the static buffer, and
        for verify rows their `DecodeRows` and verify group made once from static tensors (built per step
        from host values they would be baked into the graph)."""
        v, dev = self._views[size, q], self.model.device
        if q == 1:
            return v.batch([1] * size, [self.max_model_len] * size)
        batch = v.batch([q] * size, [self.max_model_len] * size)
        batch.verify = VerifyRows(list(range(size)), v.spec_slots, v.spec_src)
        tokens = torch.arange(size * q, device=dev)
        seqs = torch.arange(size, device=dev).repeat_interleave(q)
        batch.decode_rows = DecodeRows(tokens, seqs, self._row_ctx[: size * q], self.max_model_len, True)
        batch.verify_groups = [VerifyGroup(q, tokens, v.spec_slots, v.spec_src, whole_step=True)]
        return batch

    def table_width(self, size: int, longest: int) -> int:
        """The block-table columns a step of `size` rows travels with (`longest`: its longest table)."""
        return self.max_blocks if size * self.max_blocks <= PACKED_TABLE_LIMIT else longest

    def size_for(self, n: int, max_table_len: int, tokens: int = 1) -> int | None:
        """The ladder size a step of n sequences of `tokens` new tokens each replays, or None (the step runs
        eagerly)."""
        sizes = self.sizes if tokens == 1 else self.verify_sizes.get(tokens)
        if not sizes or n > sizes[-1] or max_table_len > self.max_blocks:
            return None
        size = next(s for s in sizes if s >= n)
        if self.model.device.type == "cuda" and (size, tokens) not in self.graphs:
            return None  # not captured (yet): the unpadded eager step is cheaper than a padded one
        return size

    def padding(self, size: int, tokens: int) -> Padding:
        """How build_step_inputs pads a step to the graph of (size, tokens)."""
        kv = self.kv
        return Padding(size, kv.scratch_block, kv.scratch_slot, tokens, self._layouts[size, tokens].spec_width)

    @torch.inference_mode()
    def run(self, inputs: StepInputs, prev_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Run the rows of `inputs` (built padded to a graph's size with prev_len `max_prev`, see ModelRunner);
        returns the logits of every token of the real rows as laid out [rows x tokens, V], a view valid
        until the next call. `prev_tokens` [<= max_prev] on the device: the ids the rows' sources point into."""
        layout, p = inputs.layout, self.max_prev
        size, w, head = layout.num_seqs, layout.width, layout.table_offset
        key = self.last_key = size, layout.num_tokens // size
        if prev_tokens is not None:
            # stream-ordered behind the sampler that wrote them and the replay before, which read prev
            self._prev[: prev_tokens.numel()].copy_(prev_tokens)
        # non-blocking: a blocking copy would wait for the step still running (async scheduling). A new
        # pinned buffer each step: torch's pinned-memory cache keeps it until this copy is done, so the
        # next step cannot overwrite it while it is in flight (models/batch.py: staged()).
        if w == self.max_blocks:
            self._buf[p : p + layout.words].copy_(inputs.flat, non_blocking=True)
        else:
            tables = self._views[key].block_tables
            self._buf[p : p + head].copy_(inputs.flat[:head], non_blocking=True)
            tables[:, :w].copy_(inputs.flat[head : head + size * w].view(size, w), non_blocking=True)
            tables[:, w:].fill_(-1)  # what a wider table of an earlier step left behind
        graph = self.graphs.get(key)
        if graph is not None:
            graph.replay()
        else:
            q = key[1]
            ctx = [c - n + q for c, n in zip(inputs.context_lens, inputs.query_lens)]  # rows as laid out
            batch = self._batches[key]
            eager = dataclasses.replace(batch, context_lens=ctx + [q] * (size - len(ctx)))
            if key[1] > 1:  # the static rows, not ones rebuilt from the host lists
                eager.decode_rows, eager.verify_groups = batch.decode_rows, batch.verify_groups
            self._step(key, eager)
        return self.logits[: len(inputs.query_lens) * key[1]]

    def _step(self, key: tuple[int, int], batch) -> None:
        size, q = key
        if q > 1:  # token j of a row sees its context up to its own position (DecodeRows)
            ctx = batch.context_lens_device[:, None] - (q - 1) + torch.arange(q, device=self._row_ctx.device)
            self._row_ctx[: size * q].copy_(ctx.view(-1))
        # each token's id: from the ids row (buffer index prev + i) or from the previous step's tokens
        pool = self._buf[: self.max_prev + size * q]
        ids = torch.index_select(pool, 0, self._views[key].id_sources)
        with tap_features(self.model, self.feature_layers) as tap:
            hidden = self.model(ids, batch, self.kv.tensors)
        if self.feature_layers:
            torch.cat(tap.outputs, -1, out=self.features[: size * q])
        self.model.compute_logits(hidden, out=self.logits[: size * q])

    def _pad_all(self, key: tuple[int, int]) -> None:
        """Every row a padding row: warm-up and capture runs write only the scratch page and slot."""
        inputs = build_step_inputs([], self.kv.block_size, pad=self.padding(*key), width=self.max_blocks,
                                   prev_len=self.max_prev, sampled=False)
        self._buf[self.max_prev : self.max_prev + inputs.layout.words].copy_(inputs.flat.to(self._buf.device))

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every ladder size on CUDA (most tokens first, so the smaller graphs reuse its memory from
        the shared pool). A size whose forward synchronises with the host (a torch reference op, the
        sorted-MoE path of float32 weights at a large batch) cannot be captured: it is left out, and
        steps of that size run eagerly."""
        if self.model.device.type != "cuda":
            return
        t0, pool, skipped = time.perf_counter(), torch.cuda.graph_pool_handle(), []
        for key in sorted(self._batches, key=lambda k: (-k[0] * k[1], k)):
            batch = self._batches[key]
            self._pad_all(key)
            try:  # Triton compiles and lazily built tensors (merged weights, rope tables) happen in the warm-up runs
                graph = capture_graph(lambda key=key, batch=batch: self._step(key, batch), pool)
            except RuntimeError as e:  # also an out-of-memory error: the smaller sizes may still fit
                skipped.append(key)
                log.warning("step of %d rows of %d tokens runs without a CUDA graph: %s", *key,
                            str(e).splitlines()[0][:200])
                continue
            self.graphs[key] = graph
        torch.cuda.synchronize()
        decode = sorted(s for s, q in self.graphs if q == 1)
        verify = {q: sorted(s for s, t in self.graphs if t == q) for q in self.verify_sizes}
        log.info("captured %d CUDA graphs in %.1f s: decode batch sizes %s%s%s", len(self.graphs),
                 time.perf_counter() - t0, decode,
                 "".join(f"; verify {q} tokens x {v}" for q, v in verify.items()),
                 f" (eager: {sorted(skipped)})" if skipped else "")
