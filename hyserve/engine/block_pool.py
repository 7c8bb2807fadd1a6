"""The raw pools under the cache manager: reference-counted pages and state slots.

Allocation is O(1) per block: free blocks live in an insertion-ordered dict used as an LRU queue, so a
freed block that still holds a cached page stays findable by hash until it is reused. The pool calls
nobody back when it reuses such a block: it records the (block, hash) pair, and its owner takes the
records (`take_evicted`) before anything can overwrite the block.
"""

from __future__ import annotations

from collections import OrderedDict


class BlockPool:
    """Reference-counted blocks; free ones queue in LRU order (oldest first = next to be reused)."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}  # hash -> block id
        self.free_queue: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self._evicted: list[tuple[int, int]] = []  # (block, hash) of cached blocks reused since taken

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    def allocate(self, n: int) -> list[int] | None:
        if n > len(self.free_queue):
            return None
        out = []
        for _ in range(n):
            b, _ = self.free_queue.popitem(last=False)
            h = self.block_hash[b]
            if h is not None:
                self._evicted.append((b, h))
                if self.cached.get(h) == b:
                    del self.cached[h]
                self.block_hash[b] = None
            self.ref_cnt[b] = 1
            out.append(b)
        return out

    def take_evicted(self) -> list[tuple[int, int]]:
        """The (block, hash) pairs of cached blocks that allocations reused since the last call."""
        out, self._evicted = self._evicted, []
        return out

    def touch(self, b: int) -> None:
        """Take a reference to a (possibly free, cached) block."""
        if self.ref_cnt[b] == 0:
            self.free_queue.pop(b, None)
        self.ref_cnt[b] += 1

    def free(self, blocks: list[int]) -> None:
        # tail blocks first, so they are evicted before the shared heads of the same request
        for b in reversed(blocks):
            self.ref_cnt[b] -= 1
            if self.ref_cnt[b] < 0:
                raise RuntimeError(f"block {b} freed twice")
            if self.ref_cnt[b] == 0:
                self.free_queue[b] = None
                if self.block_hash[b] is None:
                    self.free_queue.move_to_end(b, last=False)  # unhashed: reuse first

    def set_hash(self, b: int, h: int) -> None:
        if self.block_hash[b] is None and h not in self.cached:
            self.block_hash[b] = h
            self.cached[h] = b

    def lookup(self, h: int) -> int | None:
        return self.cached.get(h)


class SlotPool:
    """State slots `start..stop-1` of the state tensors."""

    def __init__(self, start: int, stop: int):
        self.num_slots = stop - start
        self.free_slots = list(range(stop - 1, start - 1, -1))

    @property
    def num_free(self) -> int:
        return len(self.free_slots)

    def allocate(self) -> int | None:
        return self.free_slots.pop() if self.free_slots else None

    def free(self, slot: int) -> None:
        self.free_slots.append(slot)
