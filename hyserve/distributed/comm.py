"""One process group's collectives, each failing as a CollectiveError that names the group, the rank and
the timeout instead of a backend message (or a hang: every group is created with a bounded timeout)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")
# torch 2.13 renamed the tensor forms (the old names warn); older torch has only those
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class CollectiveError(RuntimeError):
    """A collective failed: a peer rank died, raised, or did not join within the group's timeout."""


@dataclass
class Group:
    """`ranks` (global ranks, in group order) and this process's index in them. A group of one does no
    communication at all, so the single-process path needs no process group."""

    name: str
    ranks: list[int]
    rank: int
    timeout_s: float
    pg: dist.ProcessGroup | None = None
    device: torch.device = torch.device("cpu")  # where count and barrier tensors live (NCCL: the GPU)

    @property
    def size(self) -> int:
        return len(self.ranks)

    def _run(self, op: str, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except Exception as e:  # gloo raises RuntimeError, NCCL DistBackendError; both mean a broken group
            raise CollectiveError(
                f"{op} over the {self.name} group (ranks {self.ranks}) failed on its rank {self.rank}: a peer "
                f"rank failed or did not join within {self.timeout_s:g} s ({type(e).__name__}: {e})"
            ) from e

    def all_reduce(self, x: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> torch.Tensor:
        """The elementwise sum (or `op`) over the group, in place (the same bits on every rank)."""
        if self.size > 1:
            self._run("all_reduce", lambda: dist.all_reduce(x, op=op, group=self.pg))
        return x

    def all_gather(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Every rank's x (all the same shape) concatenated along `dim` in rank order."""
        if self.size == 1:
            return x
        x = x.movedim(dim, 0).contiguous()
        out = x.new_empty((self.size * x.shape[0], *x.shape[1:]))
        self._run("all_gather", lambda: _all_gather(out, x, group=self.pg))
        return out.movedim(0, dim)

    def reduce_scatter(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Chunk `rank` (of `size` equal chunks along `dim`) of the elementwise sum over the group."""
        if self.size == 1:
            return x
        if x.shape[dim] % self.size:
            raise ValueError(f"reduce_scatter: dim {dim} of size {x.shape[dim]} is not divisible by {self.size}")
        x = x.movedim(dim, 0).contiguous()
        out = x.new_empty((x.shape[0] // self.size, *x.shape[1:]))
        self._run("reduce_scatter", lambda: _reduce_scatter(out, x, group=self.pg))
        return out.movedim(0, dim)

    def all_to_all(self, x: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
        """Rows of x, send_counts[j] of them (in order) to rank j; returns recv_counts[j] rows from each rank j,
        concatenated in rank order. Counts may be uneven and zero."""
        if self.size == 1:
            return x
        out = x.new_empty((sum(recv_counts), *x.shape[1:]))
        self._run("all_to_all", lambda: dist.all_to_all_single(
            out, x.contiguous(), output_split_sizes=recv_counts, input_split_sizes=send_counts, group=self.pg))
        return out

    def exchange_counts(self, send_counts: list[int]) -> list[int]:
        """recv_counts for `all_to_all`: what every rank will send to this one."""
        if self.size == 1:
            return list(send_counts)
        send = torch.tensor(send_counts, dtype=torch.long, device=self.device)
        recv = torch.empty_like(send)
        self._run("all_to_all (counts)", lambda: dist.all_to_all_single(recv, send, group=self.pg))
        return recv.tolist()

    def barrier(self) -> None:
        if self.size > 1:  # an all_reduce of one value: the same timeout and error path as the data
            self.all_reduce(torch.zeros(1, device=self.device))
