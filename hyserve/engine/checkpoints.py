"""Prefix checkpoints: copies of a running request's KDA state at a token position (docs/ARCHITECTURE.md,
"Prefix cache").

A checkpoint at position p (= p tokens consumed) is a checkpoint slot holding a copy of the running slot's
conv + recurrent state, plus, when p is not page-aligned, a pinned reference to the partial tail page.
Rows < p % block_size of that page are never written again (the owner only appends), so pinning the
owner's block is as good as a copy and costs nothing at snapshot time. Checkpoints are never mutated.

When no checkpoint slot is free, one goes (planning/eviction.py: never a running request's resume point,
superseded ones first, then Marconi's score), to the CPU tier if there is one. Copies are queued until `flush`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from hyserve.engine.block_pool import BlockPool, SlotPool
from hyserve.engine.offload import CpuTier, unindex
from hyserve.models.batch import CacheTensors
from hyserve.planning.eviction import eviction_victim

# weight of FLOPs-saved-per-byte against recency in the eviction score (Marconi's alpha)
DEFAULT_ALPHA = 1.0


@dataclass(eq=False)
class Checkpoint:
    key: tuple[int, int]  # (prefix hash of tokens[:p], p)
    base: int  # chain hash of the p // block_size full pages (the root for p < block_size)
    p: int
    slot: int  # in the checkpoint slot range
    tail_block: int | None  # pinned page holding tokens p - p % block_size .. p - 1
    flops_saved: float  # prefill FLOPs from the next shallower checkpoint of its chain to p
    nbytes: int
    last_use: int
    owner: int = 0  # the serial of the request that took it
    covers_owner: bool = False  # it lies at or past its owner's prompt's last full page
    pending: bool = True  # its state copy is still queued
    resumed: int = 0  # requests admitted from it
    superseded: bool = False  # its session went on without it


class CheckpointStore:
    def __init__(self, slots: SlotPool, blocks: BlockPool, tensors: CacheTensors, rows: list[torch.Tensor],
                 cpu: CpuTier | None, protected: Callable[[], set[Checkpoint]] = set):
        """`rows`: the per-block tensors a tail page covers; `protected`: running requests' resume points."""
        self.slots, self.blocks, self.t, self.rows, self.cpu = slots, blocks, tensors, rows, cpu
        self.protected = protected
        self.alpha = DEFAULT_ALPHA
        self.ckpts: dict[tuple[int, int], Checkpoint] = {}
        self.by_base: dict[int, dict[tuple[int, int], Checkpoint]] = {}
        self.clock = 0
        self.num_taken = self.num_evictions = 0
        self._out: list[Checkpoint] = []  # evicted to the CPU tier; tail released after the copy
        self._snap: list[tuple[int, Checkpoint]] = []  # (running slot, the checkpoint its copy fills)

    @property
    def pinned_blocks(self) -> set[int]:
        """The pages checkpoints pin as their tails (what stays referenced once every request is done)."""
        return {c.tail_block for c in self.ckpts.values() if c.tail_block is not None}

    def at(self, base: int) -> Iterable[Checkpoint]:
        return self.by_base.get(base, {}).values()

    def used(self, c: Checkpoint) -> None:
        self.clock += 1
        c.last_use = self.clock

    def resume(self, c: Checkpoint) -> None:
        """A request was admitted from c (what supersedes what: planning/eviction.py)."""
        c.resumed += 1
        c.superseded = False
        for d in self.ckpts.values() if c.covers_owner else ():
            d.superseded |= d.owner == c.owner and d.p > c.p and d.resumed < 2

    def take(self, src_slot: int, key: tuple[int, int], base: int, p: int, tail_block: int | None,
             flops_saved: float, nbytes: int, owner: int = 0, covers_owner: bool = False,
             parent: Checkpoint | None = None) -> Checkpoint | None:
        """Queue a checkpoint of running slot `src_slot` (pinning `tail_block`), newer than `parent` on its
        chain; the one at `key` when it exists already, None when no slot can be had."""
        self.clock += 1
        if key in self.ckpts:
            self.ckpts[key].last_use = self.clock
            return self.ckpts[key]
        if self.cpu is not None and self.cpu.has_checkpoint(key):
            return None
        slot = self.slots.allocate()
        if slot is None:
            slot = self.evict(replacing=parent)  # a newer resume point can replace the request's own
            if slot is None:
                return None
        if tail_block is not None:
            self.blocks.touch(tail_block)
        c = Checkpoint(key, base, p, slot, tail_block, flops_saved, nbytes, self.clock, owner, covers_owner)
        self.ckpts[key] = c
        self.by_base.setdefault(base, {})[key] = c
        self._snap.append((src_slot, c))
        self.num_taken += 1
        if parent is not None and parent.resumed == 1:
            parent.superseded = True  # the one request that resumed from it has a newer checkpoint
        return c

    def evict(self, pins_page: bool = False, replacing: Checkpoint | None = None) -> int | None:
        """Drop one (never a protected one: a hit copies a checkpoint at admission); returns its slot."""
        keep = self.protected() - {replacing}
        cands = [c for c in self.ckpts.values()
                 if not c.pending and c not in keep and (c.tail_block is not None or not pins_page)]
        if not cands and self._snap:
            self.flush()
            cands = [c for c in self.ckpts.values() if c not in keep and (c.tail_block is not None or not pins_page)]
        if not cands:
            return None
        victim = eviction_victim(cands, self.alpha)
        unindex(self.ckpts, self.by_base, victim)
        self.num_evictions += 1
        if self.cpu is not None:
            self._out.append(victim)  # its slot is reused right away: the copy-out is queued first
        elif victim.tail_block is not None:
            self.blocks.free([victim.tail_block])
        return victim.slot

    def release_pinned_page(self) -> bool:
        """Page pressure: drop the lowest-scored checkpoint that pins a tail page. False when none does."""
        slot = self.evict(pins_page=True)
        if slot is None:
            return False
        self.flush()  # with the CPU tier the tail is released only after its copy-out
        self.slots.free(slot)
        return True

    def discard(self, c: Checkpoint) -> None:
        """Drop a checkpoint without spilling it (its slot and tail page are released)."""
        self.flush()
        unindex(self.ckpts, self.by_base, c)
        if c.tail_block is not None:
            self.blocks.free([c.tail_block])
        self.slots.free(c.slot)

    def flush(self) -> None:
        """Spill the evicted checkpoints, then run the queued snapshots (which may reuse their slots)."""
        t, dev = self.t, self.t.conv.device
        if self._out:
            out, self._out = self._out, []
            slots = torch.tensor([c.slot for c in out], device=dev)
            tails = [c.tail_block for c in out if c.tail_block is not None]
            tail_ids = torch.tensor(tails, device=dev, dtype=torch.long)
            self.cpu.put_checkpoints(
                [(c.key, c.base, c.p, c.flops_saved) for c in out], t.conv.index_select(0, slots),
                t.recurrent.index_select(0, slots), [r.index_select(0, tail_ids) for r in self.rows],
                [c.tail_block is not None for c in out],
            )
            if tails:
                self.blocks.free(tails)
        if self._snap:
            t.copy_slots([s for s, _ in self._snap], [c.slot for _, c in self._snap])
            for _, c in self._snap:
                c.pending = False
            self._snap.clear()
