"""Drafting with the DSpark drafter (any device): the Markov loop over a block and a per-request context
cache of the drafter's latent rows.

`DSparkProposer` keeps, for each request, the drafter's rows of every target token it has seen from its
first computed position on, in a `RowStore` (dspark_rows.py: per-layer buffers written in place, capacity
doubling), and drafts a block for each request from its last accepted token over the batch's rows padded
to a width bucket, so the drafter's shapes repeat. The engine integration would replace the stores by
pages (docs/speculative_decoding.md); the math stays the one here.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from hyserve.engine.sampler import _exponential_race
from hyserve.sampling_params import SAMPLING_EPS
from hyserve.spec_decode.dspark import DSparkDrafter
from hyserve.spec_decode.dspark_rows import RowStore, destinations, gather_rows, width_bucket


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
    b = hidden.shape[0]
    base = drafter.base_logits(hidden[:, :num_drafts])
    temps = [0.0] * b if temperatures is None else list(temperatures)
    sampled = [i for i, t in enumerate(temps) if t >= SAMPLING_EPS]
    t_rows = torch.tensor([max(t, SAMPLING_EPS) for t in temps], device=hidden.device).unsqueeze(1)
    gens = {i: g for i, g in enumerate(generators or []) if g is not None and i in sampled}
    prev, tokens, probs, conf = anchors, [], [], []
    for j in range(num_drafts):
        conf.append(torch.sigmoid(drafter.confidence_logits(hidden[:, j], prev)))
        logits = base[:, j] + drafter.markov_bias(prev)
        token = logits.argmax(dim=-1)
        q = torch.nn.functional.one_hot(token, logits.shape[-1]).float()
        if sampled:
            pick = torch.tensor(sampled, device=hidden.device)
            q_s = (logits[pick] / t_rows[pick]).softmax(dim=-1)
            token[pick] = _exponential_race(q_s, {n: gens[i] for n, i in enumerate(sampled) if i in gens})
            q[pick] = q_s
        tokens.append(token)
        probs.append(q)
        prev = token
    return DraftBlock(torch.stack(tokens, 1), torch.stack(probs, 1) if sampled else None, torch.stack(conf, 1))


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

    @property
    def rows(self) -> dict[str, list[Tensor]]:
        """request -> per layer [n, rank + dr], views of its store."""
        return {r: s.views() for r, s in self.stores.items()}

    @property
    def first(self) -> dict[str, int]:
        """request -> the position of its first row."""
        return {r: s.first for r, s in self.stores.items()}

    def num_context(self, req_id: str) -> int:
        """The position after the request's last row (its rows start at `first`)."""
        store = self.stores.get(req_id)
        return 0 if store is None else store.first + store.n

    @torch.no_grad()
    def add_context(self, req_id: str, features: Tensor, positions: Tensor) -> None:
        """Target features [n, m*D] of the request's next n tokens (accepted tokens only) at positions [n].
        A request's first rows may start past 0 (after a prefix hit); later ones continue them."""
        if not positions.numel():
            return
        start = int(positions[0])
        store = self.stores.get(req_id)
        if store is not None and start != self.num_context(req_id):
            raise ValueError(f"request {req_id}: context rows must arrive in order (next position "
                             f"{self.num_context(req_id)}, got {start})")
        if store is None:
            store = self.stores[req_id] = RowStore(start)
        store.append(self.drafter.context_rows(features, positions))

    def truncate(self, req_id: str, num_tokens: int) -> None:
        """Forget the rows from position num_tokens on (a recomputed or forked request)."""
        store = self.stores.get(req_id)
        if store is None:
            return
        if num_tokens <= store.first:
            self.free(req_id)
        else:
            store.truncate(num_tokens - store.first)

    def free(self, req_id: str) -> None:
        self.stores.pop(req_id, None)

    @torch.no_grad()
    def propose(self, req_ids: Sequence[str], anchors: Tensor, temperatures: Sequence[float] | None = None,
                generators: Sequence[torch.Generator | None] | None = None) -> DraftBlock:
        """A block for each request from its last accepted token anchors [B], at position `num_context`:
        the features of every token from the request's first row on must have been added. The context is
        padded to `width_bucket` of the longest (masked zero rows), so its shapes repeat from step to step."""
        stores = [self.stores.get(r) for r in req_ids]
        if any(s is None or s.n < 1 for s in stores):
            raise ValueError("a request needs the target features of at least one token before drafting")
        lens = [s.n for s in stores]
        width, dev = width_bucket(max(lens)), anchors.device
        lens_dev = torch.tensor(lens, device=dev)
        dest = destinations(lens_dev, width, sum(lens))
        ctx = [gather_rows(stores, layer, dest, width) for layer in range(len(self.drafter.layers))]
        g = self.drafter.config.block_size
        visible = (torch.arange(width, device=dev) < lens_dev.unsqueeze(1)).unsqueeze(1)
        positions = torch.tensor([s.first + s.n for s in stores], device=dev).unsqueeze(1)
        hidden = self.drafter.hidden(anchors.unsqueeze(1), positions, ctx, visible.expand(-1, g, -1))
        return draft_block(self.drafter, hidden, anchors, self.k, temperatures, generators)
