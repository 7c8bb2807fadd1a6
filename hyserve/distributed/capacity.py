"""Cache capacity per rank. Every rank plans its pools from its own free memory and its own shapes (the
rank model's config: KDA heads / TP per state slot), then all ranks take the smallest counts: the
scheduler keeps one block table and one slot table for all of them.

Under DCP a rank's page holds `page_block` of its own tokens, which are page_block * W tokens of the
sequence: the scheduler counts blocks of page_block * W tokens, and the same memory holds W times the
context that TP holds (the MLA latent and index keys are replicated under TP, split under DCP)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from hyserve.distributed.comm import Group


def agree_on_counts(group: Group, *counts: int) -> tuple[int, ...]:
    """The smallest of each count (pages, state slots, ...) over the ranks of `group`."""
    t = torch.tensor(counts, dtype=torch.long, device=group.device)
    group.all_reduce(t, op=dist.ReduceOp.MIN)
    return tuple(int(c) for c in t.tolist())


@dataclass(frozen=True)
class RankCapacity:
    rank: int
    num_blocks: int
    page_block: int  # this rank's tokens per page
    dcp: int
    num_slots: int
    page_bytes: int
    slot_bytes: int

    @property
    def scheduler_block_size(self) -> int:
        return self.page_block * self.dcp

    @property
    def context_tokens(self) -> int:
        """Tokens of sequence context the page pool holds (per DCP group: each rank stores 1/W of them)."""
        return self.num_blocks * self.scheduler_block_size

    def describe(self) -> str:
        gib = 1 << 30
        split = f" (DCP{self.dcp}: 1/{self.dcp} of them stored here)" if self.dcp > 1 else ""
        return (f"rank {self.rank}: {self.num_blocks} pages x {self.page_block} tokens = "
                f"{self.num_blocks * self.page_bytes / gib:.3f} GiB for {self.context_tokens} context tokens{split}; "
                f"{self.num_slots} KDA state slots x {self.slot_bytes / (1 << 20):.2f} MiB (this rank's heads)")
