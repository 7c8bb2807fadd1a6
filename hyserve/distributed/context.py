"""What the parallel layers of one rank share during a step: the groups, whether the step runs
sequence-parallel (each rank holding a shard of the step's tokens between the attention projections),
and the step's token count."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from hyserve.distributed.groups import ParallelState


@dataclass
class StepContext:
    state: ParallelState
    sequence_parallel: bool = False
    num_tokens: int = 0  # T, set by the model at the start of each forward

    @property
    def shard_rows(self) -> int:
        """Rows per rank of a token shard: ceil(T / TP); the last ranks' shards end in zero padding."""
        return math.ceil(self.num_tokens / self.state.tp.size)

    def token_range(self, rank: int | None = None) -> tuple[int, int]:
        """[start, stop) of the step's tokens the rank owns in a token shard (stop - start may be 0)."""
        r = self.state.tp.rank if rank is None else rank
        c = self.shard_rows
        return min(self.num_tokens, r * c), min(self.num_tokens, (r + 1) * c)

    def pad_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, ...] with zero rows appended up to shard_rows * TP."""
        short = self.shard_rows * self.state.tp.size - x.shape[0]
        return torch.cat([x, x.new_zeros((short, *x.shape[1:]))]) if short else x

    def pad_tokens_to_shard(self, x: torch.Tensor) -> torch.Tensor:
        """A shard's real rows [n, ...] with zero rows appended up to shard_rows."""
        short = self.shard_rows - x.shape[0]
        return torch.cat([x, x.new_zeros((short, *x.shape[1:]))]) if short else x

    def gather_tokens(self, shard: torch.Tensor) -> torch.Tensor:
        """Every rank's token shard [shard_rows, ...] -> the step's tokens [T, ...]."""
        return self.state.tp.all_gather(shard)[: self.num_tokens]

    def scatter_sum(self, partial: torch.Tensor) -> torch.Tensor:
        """Per-rank partial sums [T, ...] -> this rank's token shard of their sum (one reduce-scatter)."""
        return self.state.tp.reduce_scatter(self.pad_tokens(partial))

    def own_shard(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's token shard of a replicated [T, ...] (no communication)."""
        c, r = self.shard_rows, self.state.tp.rank
        return self.pad_tokens(full)[r * c : (r + 1) * c]

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """A row-parallel output's sum: replicated (all-reduce), or this rank's token shard of it (SP)."""
        return self.scatter_sum(partial) if self.sequence_parallel else self.state.tp.all_reduce(partial)

    def gather_input(self, x: torch.Tensor) -> torch.Tensor:
        """A column-parallel input: all the step's tokens (all-gathered under SP)."""
        return self.gather_tokens(x) if self.sequence_parallel else x
