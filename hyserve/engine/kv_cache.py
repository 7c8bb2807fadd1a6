"""The hybrid cache: a page pool (packed rows, one per block, every MLA layer) and a state-slot pool
(conv tail + recurrent matrix of every KDA layer), carved from one memory budget (DESIGN.md §4).

Allocation is O(1) per block: free blocks live in an insertion-ordered dict used as an LRU queue, so a
freed block that still holds a cached page stays findable by hash until it is reused.
"""

from __future__ import annotations

import gc
import logging
import weakref
from collections import OrderedDict
from collections.abc import Collection
from dataclasses import dataclass

import torch

from hyserve.config import EngineConfig
from hyserve.engine.request import Request
from hyserve.models.batch import CacheTensors
from hyserve.models.kimi import KimiForCausalLM

log = logging.getLogger(__name__)

_CPU_DEFAULT_POOL_BYTES = 1 << 30


@dataclass
class CachePlan:
    num_blocks: int
    num_slots: int  # running requests + prefix checkpoints
    num_checkpoint_slots: int
    block_size: int
    page_bytes: int  # bytes of one block row
    slot_bytes: int  # bytes of one state slot
    index_key_bytes: int = 0  # of page_bytes, the DSA index keys of one block row
    # The last block and the last slot are scratch (CUDA-graph padding rows write there): no pool holds
    # them, so no request or checkpoint can ever be given one.
    scratch: bool = False

    def describe(self) -> str:
        gib = 1 << 30
        index = ""
        if self.index_key_bytes:
            index = f", of which index keys {self.num_blocks * self.index_key_bytes / gib:.3f} GiB"
        return (
            f"KV cache: {self.num_blocks} pages x {self.block_size} tokens = {self.num_blocks * self.block_size} "
            f"cache tokens ({self.num_blocks * self.page_bytes / gib:.3f} GiB{index}); {self.num_slots} KDA state slots "
            f"({self.num_checkpoint_slots} for prefix checkpoints) x {self.slot_bytes / (1 << 20):.2f} MiB = "
            f"{self.num_slots * self.slot_bytes / gib:.3f} GiB"
            + ("; 1 page and 1 slot of these reserved as CUDA-graph padding scratch" if self.scratch else "")
        )


def plan_cache(
    cfg: EngineConfig, model: KimiForCausalLM, dtype: torch.dtype, max_model_len: int, scratch: bool = False
) -> CachePlan:
    """`scratch`: set aside one page and one state slot for CUDA-graph padding rows (CachePlan.scratch)."""
    mc = model.config
    extra = int(scratch)
    elem = torch.finfo(dtype).bits // 8
    page_bytes = max(1, len(mc.mla_layers)) * cfg.block_size * mc.kv_row_width * elem
    # DSA index keys share the block row with the latent (0 without an indexer)
    index_bytes = cfg.block_size * mc.index_key_bytes_per_token(raw_dtype_bytes=elem)
    page_bytes += index_bytes
    rec, conv = mc.kda_state_bytes(conv_dtype_bytes=elem)
    slot_bytes = max(1, rec + conv)
    if cfg.kv_cache_memory_bytes is not None:
        budget = cfg.kv_cache_memory_bytes
    elif model.device.type == "cuda":
        # an earlier engine of this process may be unreachable but not yet collected (reference cycles),
        # or its pool may sit in torch's caching allocator, which mem_get_info counts as used
        gc.collect()
        torch.cuda.empty_cache()
        free, _ = torch.cuda.mem_get_info(model.device)
        total = torch.cuda.get_device_properties(model.device).total_memory
        budget = int(free - (1 - cfg.gpu_memory_utilization) * total)
    else:
        budget = _CPU_DEFAULT_POOL_BYTES
    run_slots = cfg.max_num_seqs
    if cfg.num_checkpoint_slots is not None:
        ckpt_slots = cfg.num_checkpoint_slots
    elif cfg.enable_prefix_caching:
        ckpt_slots = max(4, min(4 * run_slots, int(0.25 * budget) // slot_bytes))
    else:
        ckpt_slots = 0
    # the scratch slot comes on top of the sized default, so max_num_seqs requests can still run; an
    # explicit --num-state-slots count includes it
    num_slots = cfg.num_state_slots if cfg.num_state_slots is not None else run_slots + ckpt_slots + extra
    if cfg.num_state_slots is not None:
        ckpt_slots = max(0, num_slots - extra - run_slots) if cfg.enable_prefix_caching else 0
    if cfg.num_gpu_blocks is not None:
        num_blocks = cfg.num_gpu_blocks
    else:
        num_blocks = (budget - num_slots * slot_bytes) // page_bytes
    if num_blocks - extra < 1 or num_slots - extra - ckpt_slots < 1:
        raise MemoryError(
            f"the cache budget ({budget / (1 << 30):.2f} GiB) cannot hold one page and {num_slots} state slots "
            f"of {slot_bytes / (1 << 20):.1f} MiB: lower --max-num-seqs or raise the memory budget"
        )
    if num_blocks * cfg.block_size < max_model_len:
        log.warning("the page pool holds %d tokens, fewer than max_model_len %d", num_blocks * cfg.block_size, max_model_len)
    return CachePlan(num_blocks, num_slots, ckpt_slots, cfg.block_size, page_bytes, slot_bytes,
                     index_key_bytes=index_bytes, scratch=scratch)


class BlockPool:
    """Reference-counted blocks; free ones queue in LRU order (oldest first = next to be reused)."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}  # hash -> block id
        self.free_queue: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        # a weakref.WeakMethod of callback(block_id, hash), called before a cached block is reused (the
        # prefix cache's CPU tier). Weak, so the prefix cache and the pool form no reference cycle: a
        # dropped engine frees its GPU pool at once rather than when the collector next runs
        self.on_evict: weakref.WeakMethod | None = None

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    def allocate(self, n: int) -> list[int] | None:
        if n > len(self.free_queue):
            return None
        out = []
        for _ in range(n):
            b, _ = self.free_queue.popitem(last=False)
            self._drop_hash(b)
            self.ref_cnt[b] = 1
            out.append(b)
        return out

    def _drop_hash(self, b: int) -> None:
        h = self.block_hash[b]
        if h is not None:
            callback = self.on_evict() if self.on_evict is not None else None
            if callback is not None:
                callback(b, h)
            if self.cached.get(h) == b:
                del self.cached[h]
            self.block_hash[b] = None

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


class KVCacheManager:
    def __init__(self, model: KimiForCausalLM, plan: CachePlan, dtype: torch.dtype):
        self.plan = plan
        self.block_size = plan.block_size
        self.tensors: CacheTensors = model.make_cache(plan.num_blocks, plan.block_size, plan.num_slots, dtype)
        extra = int(plan.scratch)
        # the scratch page and slot are the last ones, outside every pool (CachePlan.scratch)
        self.blocks = BlockPool(plan.num_blocks - extra)
        self.scratch_block: int | None = plan.num_blocks - 1 if plan.scratch else None
        usable = plan.num_slots - extra
        self.scratch_slot: int | None = usable if plan.scratch else None
        # running requests and prefix checkpoints draw from disjoint ranges of the same state tensors,
        # so checkpoints can never starve admission
        run = usable - plan.num_checkpoint_slots
        self.slots = SlotPool(0, run)
        self.checkpoint_slots = SlotPool(run, usable)

    def blocks_needed(self, req: Request, num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.block_size) - len(req.block_ids))

    def allocate(self, req: Request, num_tokens: int) -> bool:
        """Make req's block table cover `num_tokens` tokens; all or nothing."""
        need = self.blocks_needed(req, num_tokens)
        if need == 0:
            return True
        new = self.blocks.allocate(need)
        if new is None:
            return False
        req.block_ids.extend(new)
        return True

    def allocate_slot(self, req: Request) -> bool:
        if req.state_slot is None:
            slot = self.slots.allocate()
            if slot is None:
                return False
            req.state_slot = slot
            req.fresh_state = True
        return True

    def free(self, req: Request) -> None:
        self.blocks.free(req.block_ids)
        req.block_ids = []
        if req.state_slot is not None:
            self.slots.free(req.state_slot)
            req.state_slot = None

    @property
    def usage(self) -> float:
        return 1.0 - self.blocks.num_free / max(1, self.blocks.num_blocks)

    def check_empty(self, pinned_blocks: int | Collection[int] = 0) -> None:
        """Raise unless no request holds a block or a running slot. `pinned_blocks` are held by prefix
        checkpoints: a count, or (stricter) the exact block ids, which must be the only ones referenced."""
        held = [b for b, r in enumerate(self.blocks.ref_cnt) if r != 0]
        if isinstance(pinned_blocks, int):
            if len(held) != pinned_blocks:
                raise AssertionError(f"blocks still referenced: {held[:10]}")
        elif set(held) != set(pinned_blocks):
            extra, missing = sorted(set(held) - set(pinned_blocks)), sorted(set(pinned_blocks) - set(held))
            raise AssertionError(f"blocks referenced but not pinned: {extra[:10]}; pinned but free: {missing[:10]}")
        if self.slots.num_free != self.slots.num_slots:
            raise AssertionError(f"state slots leaked: {self.slots.num_slots - self.slots.num_free} not returned")
