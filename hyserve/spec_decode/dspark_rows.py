"""The drafter's context rows of one request, and the padded batch the drafter's attention reads.

A request's rows grow by the accepted count every step. Kept as one tensor per layer and extended with
torch.cat, every step copied the whole history (quadratic in the output length) and allocated anew;
`RowStore` writes them in place into per-layer buffers whose capacity is a multiple of 256 and doubles
when full, so a request reallocates about log2(n / 256) times over n rows.

The drafter's attention gets a new shape whenever the batch's widest context grows, and cuDNN and
torch's SDPA build a plan per shape (a first run over new widths took about 3x a repeat). `width_bucket`
pads the width to a power of two >= 128, so a request's shapes repeat for its whole lifetime after the
first few. Padding rows are zero and masked: a masked key's score is -inf before the softmax, so it
adds exactly 0 to every weighted sum and the real rows see what an unpadded batch computes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

ROW_CAPACITY_STEP = 256
MIN_WIDTH = 128


def width_bucket(n: int) -> int:
    """The padded context width of a batch whose longest context has n rows."""
    return max(MIN_WIDTH, 1 << (max(n, 1) - 1).bit_length())


def _round_up(n: int) -> int:
    return -(-n // ROW_CAPACITY_STEP) * ROW_CAPACITY_STEP


class RowStore:
    """One request's rows from position `first` on: per layer a [capacity, rank + dr] buffer, rows :n live."""

    def __init__(self, first: int):
        self.first, self.n = first, 0
        self.buffers: list[Tensor] = []

    @property
    def capacity(self) -> int:
        return self.buffers[0].shape[0] if self.buffers else 0

    def append(self, rows: Sequence[Tensor]) -> None:
        """rows: per layer [m, rank + dr], the next m positions."""
        m = rows[0].shape[0]
        if self.n + m > self.capacity:
            self._grow(self.n + m, rows)
        for buf, r in zip(self.buffers, rows):
            buf[self.n : self.n + m].copy_(r)
        self.n += m

    def _grow(self, need: int, like: Sequence[Tensor]) -> None:
        cap = max(2 * self.capacity, _round_up(need))
        new = [r.new_zeros(cap, r.shape[-1]) for r in like]
        for buf, old in zip(new, self.buffers):
            buf[: self.n].copy_(old[: self.n])
        self.buffers = new

    def truncate(self, keep: int) -> None:
        """Keep rows :keep (the buffers stay: the next append overwrites the rest)."""
        self.n = max(0, min(self.n, keep))

    def views(self) -> list[Tensor]:
        return [b[: self.n] for b in self.buffers]


def gather_rows(stores: Sequence[RowStore], layer: int, dest: Tensor, width: int) -> Tensor:
    """[B, width, rank + dr]: store i's rows of `layer` in row i, zeros after them; dest from `destinations`.
    One cat and one index_copy per layer instead of a copy per request."""
    flat = torch.cat([s.buffers[layer][: s.n] for s in stores])
    out = flat.new_zeros(len(stores) * width, flat.shape[-1])
    out.index_copy_(0, dest, flat)
    return out.view(len(stores), width, -1)


def destinations(lens: Tensor, width: int, total: int) -> Tensor:
    """The flat row of [B * width] that each of the `total` concatenated rows (lens [B] rows per store, on
    the device) goes to; built on the device, so no host list of `total` indices travels (output_size:
    repeat_interleave would read the total back otherwise)."""
    seq = torch.repeat_interleave(torch.arange(lens.shape[0], device=lens.device), lens, output_size=total)
    starts = torch.cumsum(lens, 0) - lens
    return seq * width + torch.arange(total, device=lens.device) - starts[seq]


def host_to_device(t: Tensor, device: torch.device) -> Tensor:
    """One copy of a small host tensor to `device` that does not wait for the stream: a copy from pageable
    memory synchronizes the stream, one from pinned memory with non_blocking does not (torch's pinned-memory
    cache keeps the block until the copy is done)."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
