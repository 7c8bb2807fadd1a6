"""Drafting with the DSpark drafter (any device): the Markov loop over a block and a per-request context
cache of the drafter's latent rows.

`DSparkProposer` keeps, for each request, the drafter's rows of every target token it has seen from its
first computed position on, in a `RowStore` (dspark_rows.py: per-layer buffers written in place, capacity
doubling), and drafts a block for each request from its last accepted token over the batch's rows padded
to a width bucket, so the drafter's shapes repeat; greedy blocks go through `DSparkGraphs` where the
engine made them (dspark_graphs.py), everything else runs here. The engine integration would replace the
stores by pages (docs/speculative_decoding.md); the math stays the one here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from hyserve.models.batch import to_device
from hyserve.sampling_params import SAMPLING_EPS
from hyserve.spec_decode.dspark import DSparkDrafter
from hyserve.spec_decode.dspark_rows import RowStore, destinations, gather_rows, host_to_device, width_bucket

if TYPE_CHECKING:
    from hyserve.spec_decode.dspark_graphs import DSparkGraphs


@dataclass
class DraftBlock:
    token_ids: Tensor  # [B, k]
    probs: Tensor | None  # [B, k, V]: the distribution each draft was drawn from; None when all are greedy
    confidence: Tensor  # [B, k]: predicted acceptance of each draft given the drafts before it


@torch.no_grad()
def draft_block(drafter: DSparkDrafter, hidden: Tensor, anchors: Tensor, num_drafts: int,
                temperatures: Sequence[float] | None = None,
                generators: Sequence[torch.Generator | None] | None = None) -> DraftBlock:
    """Drafts 0..num_drafts-1 from block hidden states [B, γ, D]: for each position add the Markov bias
    of the token before (the anchor first) to the base logits, then draw (argmax for greedy rows,
    softmax at the request's temperature otherwise). temperatures None: every row greedy."""
    temps = [0.0] * hidden.shape[0] if temperatures is None else list(temperatures)
    base = drafter.base_logits(hidden[:, :num_drafts])
    if any(t >= SAMPLING_EPS for t in temps):
        noise = torch.empty(base.shape, dtype=torch.float32, device=base.device)  # fp32 draws, as the sampler's
        draw_noise(noise, temps, generators)
        tokens, probs = sampled_loop(drafter, base, anchors, to_device(temps, torch.float32, base.device), noise)
    else:  # nothing reads the one-hot rows of greedy drafts (rejection sampling takes None as one-hot)
        tokens, probs = greedy_loop(drafter, base, anchors), None
    # confidence j reads h_j and the token before draft j: all of them are known once the loop ends
    prev = torch.cat([anchors.unsqueeze(1), tokens[:, :-1]], 1)
    conf = torch.sigmoid(drafter.confidence_logits(hidden[:, :num_drafts], prev))
    return DraftBlock(tokens, probs, conf)


def greedy_loop(drafter: DSparkDrafter, base: Tensor, anchors: Tensor) -> Tensor:
    """[B, k] argmax drafts; nothing in it reads back to the host."""
    prev, tokens = anchors, []
    for j in range(base.shape[1]):
        prev = (base[:, j] + drafter.markov_bias(prev)).argmax(dim=-1)
        tokens.append(prev)
    return torch.stack(tokens, 1)


def draw_noise(noise: Tensor, temps: Sequence[float], generators: Sequence[torch.Generator | None] | None) -> None:
    """Fill noise [B, k, V] with Exp(1) draws for the exponential race of the sampled rows (row i of
    temps >= SAMPLING_EPS): a seeded row's from its own generator, so its drafts do not depend on the rest
    of the batch; rows past temps (padding) and greedy rows from the global generator or not at all."""
    seeded = {i: g for i, g in enumerate(generators or ()) if g is not None and i < len(temps) and temps[i] >= SAMPLING_EPS}
    if len(seeded) < noise.shape[0]:
        noise.exponential_()
    for i, g in seeded.items():
        noise[i].exponential_(generator=g)


def sampled_loop(drafter: DSparkDrafter, base: Tensor, anchors: Tensor, temps: Tensor,
                 noise: Tensor) -> tuple[Tensor, Tensor]:
    """([B, k] drafts, [B, k, V] the distribution each was drawn from: one-hot for the greedy rows, temps
    [B] < SAMPLING_EPS). Row i's draft j is argmax(q / E) over noise[i, j] = E ~ Exp(1), which draws
    from q; nothing reads back to the host, so it can be captured."""
    sampled = (temps >= SAMPLING_EPS).unsqueeze(1)
    t = temps.float().clamp_min(SAMPLING_EPS).unsqueeze(1)
    tiny = torch.finfo(noise.dtype).tiny  # an exact 0 draw would make 0/0 = NaN on a masked token
    prev, tokens, probs = anchors, [], []
    for j in range(base.shape[1]):
        logits = base[:, j] + drafter.markov_bias(prev)
        greedy = logits.argmax(dim=-1)
        # fp32: rejection sampling divides by q, which must sum to 1 as the race draws from it
        q = (logits.float() / t).softmax(dim=-1)
        race = (q / noise[:, j].clamp_min(tiny)).argmax(dim=-1)
        prev = torch.where(sampled.squeeze(1), race, greedy)
        one_hot = torch.nn.functional.one_hot(greedy, logits.shape[-1]).to(q.dtype)
        tokens.append(prev)
        probs.append(torch.where(sampled, q, one_hot))
    return torch.stack(tokens, 1), torch.stack(probs, 1)


class DSparkProposer:
    def __init__(self, drafter: DSparkDrafter, num_speculative_tokens: int | None = None):
        self.drafter = drafter
        self.k = num_speculative_tokens or drafter.config.block_size
        if not 1 <= self.k <= drafter.config.block_size:
            raise ValueError(f"num_speculative_tokens must be in [1, {drafter.config.block_size}] "
                             "(the drafter's block size)")
        # request -> its rows from the position of its first row on: a prefix-cache hit computes (and taps
        # the target features of) only the positions after the hit, so the drafter sees the context from there
        self.stores: dict[str, RowStore] = {}
        self._queued: list[tuple[RowStore, Tensor, int]] = []  # (store, features, first position)
        self._queued_rows = 0
        self._ends: dict[str, int] = {}  # request -> the position after its last row, queued ones included
        self.graphs: DSparkGraphs | None = None  # the greedy step's static buffers (and graphs), if the engine made them

    @property
    def rows(self) -> dict[str, list[Tensor]]:
        """request -> per layer [n, rank + dr], views of its store."""
        self.flush()
        return {r: s.views() for r, s in self.stores.items()}

    @property
    def first(self) -> dict[str, int]:
        """request -> the position of its first row."""
        return {r: s.first for r, s in self.stores.items()}

    @property
    def queued_rows(self) -> int:
        """Positions added since the last `flush`, whose rows are not computed yet (a count kept as they
        queue: the engine asks every step, and deferred rows queue thousands of entries)."""
        return self._queued_rows

    def num_context(self, req_id: str) -> int:
        """The position after the request's last row (its rows start at `first`)."""
        return self._ends.get(req_id, 0)

    def add_context(self, req_id: str, features: Tensor, positions: Tensor) -> None:
        """Target features [n, m*D] of the request's next n tokens (accepted tokens only) at positions [n],
        consecutive. A request's first rows may start past 0 (after a prefix hit); later ones continue
        them. The rows are computed at the next `flush` (or anything that reads them), for every request
        queued since in one drafter call; `features` must stay unchanged until then. Positions on the host
        cost no read-back."""
        n = positions.numel()
        if not n:
            return
        start, last = positions[[0, -1]].tolist()
        if last != start + n - 1:
            raise ValueError(f"request {req_id}: context positions must be consecutive")
        self.extend(req_id, features, start)

    def extend(self, req_id: str, features: Tensor, start: int) -> None:
        """`add_context` of positions start .. start + n - 1 (no position tensor: the engine adds every
        running request's rows every step, and a tensor op costs microseconds each)."""
        n = features.shape[0]
        if not n:
            return
        store = self.stores.get(req_id)
        if store is not None and start != self.num_context(req_id):
            raise ValueError(f"request {req_id}: context rows must arrive in order (next position "
                             f"{self.num_context(req_id)}, got {start})")
        if store is None:
            store = self.stores[req_id] = RowStore(start)
        self._queued.append((store, features, start))
        self._queued_rows += n
        self._ends[req_id] = start + n

    @torch.no_grad()
    def flush(self) -> None:
        """Compute the queued rows: one drafter call over the features of every request queued (a call per
        request launched ~40 kernels each), their positions in one host-to-device copy. The features go in
        request by request (the rows are computed position by position, so their order changes nothing), so
        each request's rows land in one append: rows deferred over many steps (engine_dspark.py) queue an
        entry per request and step, and a copy per entry and layer made the step that computed 2,000 of them
        (batch 32) take ~50 ms instead of ~11 on an H100."""
        if not self._queued:
            return
        queued, self._queued, self._queued_rows = self._queued, [], 0
        groups: dict[int, tuple[RowStore, int, list[Tensor]]] = {}  # a request's entries: consecutive positions
        for store, f, p in queued:
            groups.setdefault(id(store), (store, p, []))[2].append(f)
        parts = [f for _, _, fs in groups.values() for f in fs]
        feats = torch.cat(parts) if len(parts) > 1 else parts[0]
        sizes = [sum(f.shape[0] for f in fs) for _, _, fs in groups.values()]
        pos = torch.cat([torch.arange(p, p + n) for (_, p, _), n in zip(groups.values(), sizes)])
        rows = self.drafter.context_rows(feats, host_to_device(pos, feats.device))
        at = 0
        for (store, _, _), n in zip(groups.values(), sizes):
            store.append([r[at : at + n] for r in rows])
            at += n

    def truncate(self, req_id: str, num_tokens: int) -> None:
        """Forget the rows from position num_tokens on (a recomputed or forked request)."""
        store = self.stores.get(req_id)
        if store is None or num_tokens >= self._ends[req_id]:
            return
        self.flush()
        if num_tokens <= store.first:
            self.free(req_id)
        else:
            store.truncate(num_tokens - store.first)
            self._ends[req_id] = num_tokens

    def free(self, req_id: str) -> None:
        store = self.stores.pop(req_id, None)
        self._ends.pop(req_id, None)
        if store is not None:
            self._queued = [q for q in self._queued if q[0] is not store]
            self._queued_rows = sum(f.shape[0] for _, f, _ in self._queued)

    @torch.no_grad()
    def propose(self, req_ids: Sequence[str], anchors: Tensor, temperatures: Sequence[float] | None = None,
                generators: Sequence[torch.Generator | None] | None = None) -> DraftBlock:
        """A block for each request from its last accepted token anchors [B] (on the host or the device),
        at position `num_context`: the features of every token from the request's first row on must have
        been added. The context is padded to `width_bucket` of the longest (masked zero rows), so its
        shapes repeat from step to step; the step's lengths, positions and host anchors travel in one copy."""
        self.flush()
        stores = [self.stores.get(r) for r in req_ids]
        if any(s is None or s.n < 1 for s in stores):
            raise ValueError("a request needs the target features of at least one token before drafting")
        lens = [s.n for s in stores]
        greedy = temperatures is None or all(t < SAMPLING_EPS for t in temperatures)
        key = None if self.graphs is None else self.graphs.key_for(len(stores), max(lens), sampled=not greedy)
        if key is not None:
            return self.graphs.draft(stores, anchors, key, None if greedy else temperatures, generators)
        dev = self.drafter.fc.weight.device
        host = [lens, [s.first + s.n for s in stores]]
        on_host = anchors.device.type == "cpu"
        if on_host:
            host.append(anchors.tolist())
        meta = host_to_device(torch.tensor(host, dtype=torch.long), dev)
        lens_dev, positions = meta[0], meta[1]
        anchors = meta[2] if on_host else anchors
        width = width_bucket(max(lens))
        dest = destinations(lens_dev, width, sum(lens))
        ctx = [gather_rows(stores, layer, dest, width) for layer in range(len(self.drafter.layers))]
        g = self.drafter.config.block_size
        visible = (torch.arange(width, device=dev) < lens_dev.unsqueeze(1)).unsqueeze(1)
        hidden = self.drafter.hidden(anchors.unsqueeze(1), positions.unsqueeze(1), ctx, visible.expand(-1, g, -1))
        return draft_block(self.drafter, hidden, anchors, self.k, temperatures, generators)
