"""CUDA graphs of the DSpark drafter's drafting step (docs/speculative_decoding.md §2).

An eager greedy block launches about 30 kernels per draft layer and 4 per draft position, and at the tiny
target's sizes the host takes longer to launch them than the GPU to run them. The forward depends only on
the batch size and the context width, so one graph per (batch-size bucket, width bucket) replays
`draft_step`: the drafter's hidden states over the context rows, then per position base logits + the
Markov bias of the token before and argmax (or the exponential race, below), then the confidences.

Static inputs: `meta` [3, B] (context lengths, anchor positions, anchors: one non-blocking copy of a
pinned host tensor per step) and per draft layer a [B * W, rank + dr] row buffer that each step's rows
are gathered into (one cat and one index_copy per layer, before the replay). Rows past a request's length
are whatever an earlier step left there, finite (the buffers start at zero): the visibility mask, made
from the lengths inside the graph, hides them, and a masked key adds exactly 0. Padding requests have
length 0 and anchor 0: their queries see only their own block, and their drafts are dropped.

Sampled drafting (draft_sample_method "probabilistic", temperature > 0) has graphs of its own per key: the
step's temperatures [B] and the Exp(1) noise of the exponential race [B, k, V] are static inputs, drawn
before the replay (a seeded request's from its generator, as the eager `draft_block` draws them), and the
drafts' distributions a static output. On the CPU nothing is captured: `draft` runs `draft_step` over the
same static buffers, which lets CPU tests check everything but the replay.
"""

from __future__ import annotations

import logging
import time

import torch
from torch import Tensor

from hyserve.models.segment_graphs import capture_graph
from hyserve.spec_decode.dspark import DSparkDrafter
from hyserve.spec_decode.dspark_propose import DraftBlock, draw_noise, greedy_loop, sampled_loop
from hyserve.spec_decode.dspark_rows import MIN_WIDTH, RowStore, destinations, host_to_device, width_bucket

log = logging.getLogger(__name__)


def draft_step(drafter: DSparkDrafter, meta: Tensor, ctx: list[Tensor], k: int,
                 temps: Tensor | None = None, noise: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor | None]:
    """([B, k] drafts, [B, k] confidences, [B, k, V] draft distributions or None) of a batch: meta [3, B]
    (context lengths, anchor positions, anchors), ctx per draft layer [B, W, rank + dr] (rows :length of
    each request visible); with temps [B] and noise [B, k, V] (Exp(1) draws) the rows of temperature >=
    SAMPLING_EPS draw by the exponential race (`sampled_loop`), the others argmax. Nothing in it reads back
    to the host, so it can be captured."""
    lens, positions, anchors = meta[0], meta[1], meta[2]
    width, g = ctx[0].shape[1], drafter.config.block_size
    visible = (torch.arange(width, device=meta.device) < lens.unsqueeze(1)).unsqueeze(1).expand(-1, g, -1)
    hidden = drafter.hidden(anchors.unsqueeze(1), positions.unsqueeze(1), ctx, visible)
    base = drafter.base_logits(hidden[:, :k])
    probs = None
    if temps is None:
        tokens = greedy_loop(drafter, base, anchors)
    else:
        tokens, probs = sampled_loop(drafter, base, anchors, temps, noise)
    prev = torch.cat([anchors.unsqueeze(1), tokens[:, :-1]], 1)
    return tokens, torch.sigmoid(drafter.confidence_logits(hidden[:, :k], prev)), probs


def width_ladder(max_rows: int) -> list[int]:
    """Every width bucket a context of at most max_rows rows can take."""
    top, w, out = width_bucket(max_rows), MIN_WIDTH, []
    while w <= top:
        out.append(w)
        w *= 2
    return out


def bytes_per_row(drafter: DSparkDrafter) -> int:
    """About what one context row of a drafting step holds on the device: its latent row in every draft
    layer's static buffer, and the keys and values each layer expands it to (the graph's activations)."""
    c = drafter.config
    per_layer = c.kv_lora_rank + c.qk_rope_head_dim + 2 * c.num_heads * (2 * c.qk_nope_head_dim + c.qk_rope_head_dim + c.v_head_dim)
    return per_layer * len(drafter.layers) * drafter.fc.weight.element_size()


# sampled drafting's static noise and distributions, [B, k, V] fp32 each, for batch sizes within this
# (a K3 vocabulary at k = 7: 9.2 MB a request, so 55 requests)
SAMPLED_BYTES = 1 << 29


class DSparkGraphs:
    """Static buffers for every (batch size, width) of `batch_sizes` x `widths` of at most `max_rows`
    context rows in all (None: no bound), and on CUDA after `capture` their graphs; with `sampled` also a
    graph per key of sampled drafting (draft_sample_method "probabilistic"), for the batch sizes whose
    noise and distributions fit SAMPLED_BYTES. Larger steps run eagerly: a long max_model_len times a
    large batch would otherwise ask for more memory than the cache left (64 requests x 64K rows is 4.8 GB
    a layer for the rows alone at a K3-sized latent)."""

    def __init__(self, drafter: DSparkDrafter, k: int, batch_sizes: list[int], widths: list[int],
                 max_rows: int | None = None, sampled: bool = False):
        self.drafter, self.k = drafter, k
        fits = [(b, w) for b in sorted(batch_sizes) for w in sorted(widths) if max_rows is None or b * w <= max_rows]
        vocab = drafter.config.vocab_size
        sampled_batch = min(max((b for b, _ in fits), default=0), SAMPLED_BYTES // (2 * 4 * k * vocab)) if sampled else 0
        self.keys = {(b, w, False) for b, w in fits} | {(b, w, True) for b, w in fits if b <= sampled_batch}
        self.batch_sizes = sorted({b for b, _ in fits}) or [0]
        self.widths = sorted({w for _, w in fits}) or [0]
        dev, dtype = drafter.fc.weight.device, drafter.fc.weight.dtype
        rows = max((b * w for b, w in fits), default=0)
        row = drafter.config.kv_lora_rank + drafter.config.qk_rope_head_dim
        n, ns = self.batch_sizes[-1], max((b for b, _, s in self.keys if s), default=0)
        with torch.no_grad():
            self.meta = torch.zeros(3, n, dtype=torch.long, device=dev)
            self.rows = [torch.zeros(rows, row, dtype=dtype, device=dev) for _ in drafter.layers]
            self.tokens = torch.zeros(n, k, dtype=torch.long, device=dev)
            self.confidence = torch.zeros(n, k, dtype=torch.float32, device=dev)
            self.temps = torch.zeros(ns, dtype=torch.float32, device=dev)
            self.noise = torch.ones(ns, k, vocab, dtype=torch.float32, device=dev)
            self.probs = torch.zeros(ns, k, vocab, dtype=torch.float32, device=dev)
        self.graphs: dict[tuple[int, int, bool], torch.cuda.CUDAGraph] = {}

    def key_for(self, batch: int, longest: int, sampled: bool = False) -> tuple[int, int, bool] | None:
        """The (batch size, width, sampled) a step of `batch` requests whose longest context has `longest`
        rows replays, or None (it runs eagerly)."""
        w = width_bucket(longest)
        if batch > self.batch_sizes[-1] or w > self.widths[-1]:
            return None
        key = next(s for s in self.batch_sizes if s >= batch), w, sampled
        if key not in self.keys or (self.meta.device.type == "cuda" and key not in self.graphs):
            return None
        return key

    def _run(self, key: tuple[int, int, bool]) -> None:
        b, w, sampled = key
        ctx = [r[: b * w].view(b, w, -1) for r in self.rows]
        extra = (self.temps[:b], self.noise[:b]) if sampled else ()
        tokens, conf, probs = draft_step(self.drafter, self.meta[:, :b], ctx, self.k, *extra)
        self.tokens[:b].copy_(tokens)  # static outputs: the graph's own tensors go back to the shared pool
        self.confidence[:b].copy_(conf)
        if sampled:
            self.probs[:b].copy_(probs)

    @torch.no_grad()
    def draft(self, stores: list[RowStore], anchors: Tensor, key: tuple[int, int, bool],
              temperatures: list[float] | None = None,
              generators: list[torch.Generator | None] | None = None) -> DraftBlock:
        """Drafts for requests with these row stores and anchors [B] (host or device), through the graph
        of `key`: greedy, or (a sampled key) at `temperatures` with each seeded request's noise from its
        generator."""
        b, w, sampled = key
        n = len(stores)
        pad = [0] * (b - n)
        host = [[s.n for s in stores] + pad, [s.first + s.n for s in stores] + pad]
        on_host = anchors.device.type == "cpu"
        host.append(anchors.tolist() + pad if on_host else [0] * b)
        self.meta[:, :b].copy_(host_to_device(torch.tensor(host, dtype=torch.long), self.meta.device))
        if not on_host:
            self.meta[2, :n].copy_(anchors)
        dest = destinations(self.meta[0, :n], w, sum(s.n for s in stores))
        for layer, buf in enumerate(self.rows):
            buf.index_copy_(0, dest, torch.cat([s.buffers[layer][: s.n] for s in stores]).to(buf.dtype))
        if sampled:
            temps = list(temperatures) + [0.0] * (b - n)
            self.temps[:b].copy_(host_to_device(torch.tensor(temps, dtype=torch.float32), self.temps.device))
            draw_noise(self.noise[:b], temps, generators)
        graph = self.graphs.get(key)
        if graph is not None:
            graph.replay()
        else:
            self._run(key)
        probs = self.probs[:n].clone() if sampled else None
        return DraftBlock(self.tokens[:n].clone(), probs, self.confidence[:n].clone())

    @torch.no_grad()
    def capture(self) -> None:
        """Capture every key on CUDA, most work first so the smaller graphs reuse its memory from the shared
        pool; a key that cannot be captured (out of memory) is left out and runs eagerly."""
        if self.meta.device.type != "cuda":
            return
        t0, pool, skipped = time.perf_counter(), torch.cuda.graph_pool_handle(), []
        self.meta.zero_()  # every request a padding request while capturing
        for key in sorted(self.keys, key=lambda k: (-k[0] * k[1], -k[2], k)):
            try:
                self.graphs[key] = capture_graph(lambda key=key: self._run(key), pool)
            except RuntimeError as e:
                skipped.append(key)
                log.warning("drafter step of %d requests x %d rows (sampled: %s) runs without a CUDA graph: %s",
                            *key, str(e).splitlines()[0][:200])
        torch.cuda.synchronize()
        log.info("captured %d drafter CUDA graphs in %.1f s: batch sizes %s, widths %s%s", len(self.graphs),
                 time.perf_counter() - t0, self.batch_sizes, self.widths,
                 f" (eager: {sorted(skipped)})" if skipped else "")
