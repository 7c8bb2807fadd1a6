"""The CPU tier of the prefix cache (docs/ARCHITECTURE.md, "Prefix cache"): pages and KDA checkpoints
evicted from the GPU pools.

Pages are keyed by their chain hash; checkpoints by (prefix hash, position) and indexed by the hash of
their full pages (`base`) like the GPU checkpoints, so one lookup walk sees both tiers. Storage is
preallocated (pinned when CUDA is present, so copies can overlap) and each tier evicts LRU. Callers pass
whole batches: one index_select on the GPU and one index_copy here per batch, never a loop of tiny copies.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

import torch

from hyserve.models.batch import CacheTensors

log = logging.getLogger(__name__)

# Share of the CPU budget reserved for checkpoints (state slot + tail page each); the rest holds pages.
# Checkpoints are what make pages usable at all for a hybrid model, so they get a fixed floor.
_CHECKPOINT_SHARE = 0.25


@dataclass(eq=False)
class CpuCheckpoint:
    key: tuple[int, int]  # (prefix hash of tokens[:p], p)
    base: int  # chain hash of the p // block_size full pages
    p: int
    row: int
    has_tail: bool
    flops_saved: float


def unindex(ckpts: dict, by_base: dict, c) -> None:
    """Take checkpoint `c` out of a tier's two indexes: by key, and by the hash of its full pages."""
    del ckpts[c.key]
    group = by_base[c.base]
    del group[c.key]
    if not group:
        del by_base[c.base]


def _nbytes(t: torch.Tensor) -> int:
    return t[0].numel() * t.element_size()


class CpuTier:
    def __init__(self, capacity_bytes: int, tensors: CacheTensors):
        pin = torch.cuda.is_available()
        # every per-block tensor travels with the block (MLA rows, and DSA index keys when present)
        page_like = [tensors.pages] + ([tensors.index_keys] if tensors.index_keys is not None else [])
        page_bytes = sum(_nbytes(t) for t in page_like)
        slot_bytes = _nbytes(tensors.conv) + _nbytes(tensors.recurrent)
        n_ckpt = int(capacity_bytes * _CHECKPOINT_SHARE) // (slot_bytes + page_bytes)
        n_pages = (capacity_bytes - n_ckpt * (slot_bytes + page_bytes)) // page_bytes

        def alloc(n: int, like: torch.Tensor) -> torch.Tensor:
            return torch.empty((n, *like.shape[1:]), dtype=like.dtype, pin_memory=pin)

        self.pages = [alloc(n_pages, t) for t in page_like]
        self.conv, self.recurrent = alloc(n_ckpt, tensors.conv), alloc(n_ckpt, tensors.recurrent)
        self.tails = [alloc(n_ckpt, t) for t in page_like]
        self.page_rows: OrderedDict[int, int] = OrderedDict()  # hash -> row, oldest first
        self.free_page_rows = list(range(n_pages - 1, -1, -1))
        self.ckpts: OrderedDict[tuple[int, int], CpuCheckpoint] = OrderedDict()
        self.by_base: dict[int, dict[tuple[int, int], CpuCheckpoint]] = {}
        self.free_ckpt_rows = list(range(n_ckpt - 1, -1, -1))
        self.num_page_capacity, self.num_ckpt_capacity = n_pages, n_ckpt
        self.pages_in = self.pages_out = self.ckpts_in = self.ckpts_out = 0

    def describe(self) -> str:
        held = [*self.pages, self.conv, self.recurrent, *self.tails]
        gib = sum(t.nbytes for t in held) / (1 << 30)
        return f"CPU tier {gib:.3f} GiB: {self.num_page_capacity} pages, {self.num_ckpt_capacity} checkpoints"

    # ---- pages -----------------------------------------------------------------------------------
    def has_page(self, h: int) -> bool:
        return h in self.page_rows

    def put_pages(self, hashes: list[int], data: list[torch.Tensor]) -> None:
        """Store row i of each per-block tensor in `data` under `hashes[i]` (one batch, evicting the oldest
        pages); known ones are refreshed."""
        if self.num_page_capacity == 0:
            return
        rows, src = [], []
        for i, h in enumerate(hashes):
            if h in self.page_rows:
                self.page_rows.move_to_end(h)
                continue
            if not self.free_page_rows:
                _, row = self.page_rows.popitem(last=False)
                self.free_page_rows.append(row)
            row = self.free_page_rows.pop()
            self.page_rows[h] = row
            rows.append(row)
            src.append(i)
        if rows:
            dst = torch.tensor(rows)
            for store, d in zip(self.pages, data):
                picked = d if len(src) == len(hashes) else d[torch.tensor(src, device=d.device)]
                store.index_copy_(0, dst, picked.to("cpu"))
            self.pages_out += len(rows)

    def gather_pages(self, hashes: list[int]) -> list[torch.Tensor]:
        """The pages stored under `hashes`, stacked per per-block tensor (one gather each; the caller moves
        them in one copy)."""
        rows = []
        for h in hashes:
            self.page_rows.move_to_end(h)
            rows.append(self.page_rows[h])
        self.pages_in += len(rows)
        idx = torch.tensor(rows)
        return [store.index_select(0, idx) for store in self.pages]

    # ---- checkpoints -----------------------------------------------------------------------------
    def has_checkpoint(self, key: tuple[int, int]) -> bool:
        return key in self.ckpts

    def checkpoints_at(self, base: int) -> list[CpuCheckpoint]:
        return list(self.by_base.get(base, {}).values())

    def put_checkpoints(
        self, metas: list[tuple[tuple[int, int], int, int, float]], conv: torch.Tensor, recurrent: torch.Tensor,
        tails: list[torch.Tensor], has_tail: list[bool],
    ) -> None:
        """metas[i] = (key, base, p, flops_saved) for state `conv[i]`/`recurrent[i]`; each tensor of `tails`
        (one per per-block tensor) holds one row per True entry of `has_tail`, in order."""
        if self.num_ckpt_capacity == 0:
            return
        rows, src, tail_rows, tail_src, t = [], [], [], [], 0
        for i, (key, base, p, saved) in enumerate(metas):
            if key in self.ckpts:
                self.ckpts.move_to_end(key)
            else:
                if not self.free_ckpt_rows:
                    self._drop_checkpoint(next(iter(self.ckpts.values())))
                row = self.free_ckpt_rows.pop()
                c = CpuCheckpoint(key, base, p, row, has_tail[i], saved)
                self.ckpts[key] = c
                self.by_base.setdefault(base, {})[key] = c
                rows.append(row)
                src.append(i)
                if has_tail[i]:
                    tail_rows.append(row)
                    tail_src.append(t)
            t += has_tail[i]
        if rows:
            idx, dst = torch.tensor(src, device=conv.device), torch.tensor(rows)
            self.conv.index_copy_(0, dst, conv[idx].to("cpu"))
            self.recurrent.index_copy_(0, dst, recurrent[idx].to("cpu"))
            self.ckpts_out += len(rows)
        if tail_rows:
            dst = torch.tensor(tail_rows)
            for store, d in zip(self.tails, tails):
                store.index_copy_(0, dst, d[torch.tensor(tail_src, device=d.device)].to("cpu"))

    def _drop_checkpoint(self, c: CpuCheckpoint) -> None:
        unindex(self.ckpts, self.by_base, c)
        self.free_ckpt_rows.append(c.row)

    def read_checkpoint(self, c: CpuCheckpoint) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor] | None]:
        """(conv, recurrent, tail rows per per-block tensor or None) of a checkpoint, refreshed as most
        recently used."""
        self.ckpts.move_to_end(c.key)
        self.ckpts_in += 1
        return self.conv[c.row], self.recurrent[c.row], [t[c.row] for t in self.tails] if c.has_tail else None
