"""The hybrid cache and the one API over it (docs/ARCHITECTURE.md, "Cache").

The cache is a page pool (packed rows, one per block, every MLA layer and its DSA index keys) and a
state-slot pool (conv tail + recurrent matrix of every KDA layer), carved from one memory budget. The
scheduler and the engine call only `KVCacheManager`, in vLLM's shape: find the prefix hit
(`get_computed_tokens`), allocate slots for a step (`allocate_slots`), mark a step's tokens computed
(`begin_step`), cache what a step computed (`cache_blocks`), free (`free`, also what preemption does).
Under it are the per-kind stores: the block pool (pages), the running state slots, and the prefix cache
with its checkpoints (or `NoPrefixCache`). It alone writes a request's block table, computed-token count,
state slot and fresh-state flag.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Collection
from dataclasses import dataclass

import torch

from hyserve.config import EngineConfig
from hyserve.engine.block_pool import BlockPool, SlotPool
from hyserve.engine.prefix_cache import NO_HIT, NoPrefixCache, PrefixCache, PrefixHit
from hyserve.engine.request import Request
from hyserve.models.batch import CacheTensors
from hyserve.models.kimi import KimiForCausalLM
from hyserve.planning.cache_split import checkpoint_slots

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


def state_row_width(cfg: EngineConfig) -> int:
    """State slots a running sequence takes: one per verified position (1 + num_speculative_tokens) when
    speculating, else one."""
    spec = cfg.speculative_config
    return 1 + spec.num_speculative_tokens if spec is not None else 1


def device_cache_budget(free: int, total: int, utilization: float, activation_bytes: int) -> int:
    """The bytes the cache may take on a device: total x utilization less what is in use now (total - free:
    weights, buffers, the CUDA context, other processes) less the largest steps' peak."""
    return int(free - (1 - utilization) * total) - activation_bytes


def plan_cache(
    cfg: EngineConfig, model: KimiForCausalLM, dtype: torch.dtype, max_model_len: int, scratch: bool = False,
    activation_bytes: int = 0,
) -> CachePlan:
    """`scratch`: set aside one page and one state slot for CUDA-graph padding rows (CachePlan.scratch).
    `activation_bytes`: what the largest steps allocate beside the cache (planning/memory_profile.py), kept
    out of the budget on CUDA. A model split over ranks plans on them (distributed/executor.py
    `RankWorkers.plan_cache`)."""
    if hasattr(model, "plan_cache"):
        return model.plan_cache(cfg, dtype, max_model_len, scratch)
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
        budget = device_cache_budget(free, total, cfg.gpu_memory_utilization, activation_bytes)
    else:
        budget = _CPU_DEFAULT_POOL_BYTES
    spec = cfg.speculative_config
    # a speculating request owns a row of 1+K state slots, one per verified position
    run_slots = cfg.max_num_seqs * state_row_width(cfg)
    ckpt_slots = checkpoint_slots(cfg, budget, slot_bytes)  # sized from the workload
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
        steps = f" after {activation_bytes / (1 << 30):.2f} GiB for the largest steps" if activation_bytes else ""
        raise MemoryError(
            f"the cache budget ({budget / (1 << 30):.2f} GiB{steps}) cannot hold one page and {num_slots} state "
            f"slots of {slot_bytes / (1 << 20):.1f} MiB: lower --max-num-seqs or --max-num-batched-tokens, or "
            "raise --gpu-memory-utilization (or --kv-cache-memory-bytes)"
            + (" (speculative decoding takes 1 + num_speculative_tokens slots per sequence)" if spec is not None else "")
        )
    if num_blocks * cfg.block_size < max_model_len:
        log.warning("the page pool holds %d tokens, fewer than max_model_len %d", num_blocks * cfg.block_size, max_model_len)
    return CachePlan(num_blocks, num_slots, ckpt_slots, cfg.block_size, page_bytes, slot_bytes,
                     index_key_bytes=index_bytes, scratch=scratch)


class KVCacheManager:
    def __init__(self, cfg: EngineConfig, model: KimiForCausalLM, plan: CachePlan, dtype: torch.dtype):
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
        self.spec_width = state_row_width(cfg)
        self.prefix: NoPrefixCache = NoPrefixCache()
        if cfg.enable_prefix_caching:
            self.prefix = PrefixCache(cfg, self.blocks, self.checkpoint_slots, self.tensors, plan.block_size,
                                      plan.slot_bytes, plan.page_bytes, model.config)

    # ---- admission and growth --------------------------------------------------------------------
    def get_computed_tokens(self, req: Request) -> PrefixHit:
        """The prefix hit a waiting request would start from (NO_HIT without one); takes nothing."""
        return self.prefix.find(req)

    def allocate_slots(self, req: Request, num_new_tokens: int, hit: PrefixHit | None = None) -> int:
        """Pages for req's next `num_new_tokens` tokens; at admission (`hit` given) first a state slot and
        the hit (a shallower one, then none, when the pool cannot hold the hit's new pages). Returns the
        tokens granted: fewer when the chunk must end where the prefix cache keeps a checkpoint, 0 when
        the pool is short (then req holds exactly what it held before)."""
        if hit is not None:
            hit = self._admit(req, hit)
            if hit is None:
                return 0
        n = self.prefix.limit_chunk(req, num_new_tokens)
        # pages pinned by prefix checkpoints are cache, not work: release them before giving up, or a
        # small pool preempts (and finally fails) requests while checkpoints hold its pages
        while not self._grow(req, req.num_computed_tokens + n):
            if not self.prefix.release_pinned_page():
                if hit is not None:  # admission failed: undo it
                    self._release(req)
                    req.num_cached_tokens = req.num_external_cached_tokens = 0
                return 0
        if hit is not None:
            self.prefix.admitted(req, hit)
        return n

    def _admit(self, req: Request, hit: PrefixHit) -> PrefixHit | None:
        slot = self.slots.allocate() if self.spec_width == 1 else self._allocate_row(req)
        if slot is None:
            return None
        req.state_slot, req.fresh_state = slot, True
        while hit.num_tokens:
            blocks = self.prefix.load(req, hit, slot)
            if blocks is not None:
                req.block_ids, req.fresh_state = blocks, False
                req.num_computed_tokens = req.num_cached_tokens = hit.num_tokens
                req.num_external_cached_tokens = hit.num_tokens if hit.external else 0
                break
            # the pages to load from the CPU tier do not fit: the longest hit that needs none
            hit = self.prefix.find(req, gpu_only=True) if hit.needs_cpu else NO_HIT
        self.prefix.start(req, hit)
        return hit

    def _allocate_row(self, req: Request) -> int | None:
        """A speculating request's 1+K state slots, all or nothing; column 0 is its state until a verify
        step lands."""
        if self.slots.num_free < self.spec_width:
            return None
        req.spec_slots = [self.slots.allocate() for _ in range(self.spec_width)]
        return req.spec_slots[0]

    def land_verify(self, req: Request, start: int, accepted: int) -> None:
        """A verify step from position `start` kept `accepted` drafts: the state after them is in column
        `accepted`, the positions after them are not computed, and pages wholly past them go back."""
        req.state_slot = req.spec_slots[accepted]
        req.num_computed_tokens = start + 1 + accepted
        keep = -(-req.num_computed_tokens // self.block_size)
        if len(req.block_ids) > keep:
            self.blocks.free(req.block_ids[keep:])
            del req.block_ids[keep:]

    def _grow(self, req: Request, num_tokens: int) -> bool:
        """Make req's block table cover `num_tokens` tokens; all or nothing."""
        need = -(-num_tokens // self.block_size) - len(req.block_ids)
        if need <= 0:
            return True
        new = self.blocks.allocate(need)
        if new is None:
            return False
        req.block_ids.extend(new)
        return True

    # ---- a step ----------------------------------------------------------------------------------
    def begin_step(self, out) -> None:
        """The step's forward is about to be queued: the queued cache copies go first (the forward
        overwrites what they read), and its tokens count as computed."""
        self.prefix.flush()
        for s in out.seqs:
            s.req.num_computed_tokens = s.end
            s.req.fresh_state = False

    def cache_blocks(self, out) -> None:
        """The step's token ids are known (or, async, those that are): register its full pages and take
        the checkpoints planned at its end positions."""
        self.prefix.cache_blocks(out.seqs)

    def free(self, req: Request, cache: bool = True) -> None:
        """Finish, abort or preemption: the prefix cache keeps what it retains of the request (nothing
        when `cache` is False: a failed step leaves its contents suspect), then everything is released
        and the request would start over."""
        if cache:
            self.prefix.retain(req)
        else:
            self.prefix.forget(req)
        self._release(req)

    def _release(self, req: Request) -> None:
        self.blocks.free(req.block_ids)
        req.block_ids = []
        for slot in req.spec_slots or ([req.state_slot] if req.state_slot is not None else []):
            self.slots.free(slot)
        req.state_slot, req.spec_slots = None, None
        req.num_computed_tokens = 0
        req.fresh_state = True

    # ---- state -----------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.blocks.num_blocks

    @property
    def prefix_stats(self) -> tuple[int, int]:
        """(prompt tokens looked up, prompt tokens hit): vLLM's prefix_cache_queries and _hits."""
        return self.prefix.queries, self.prefix.hits

    @property
    def pool_stats(self) -> dict[str, int]:
        """Free and total sizes of the pools: the /metrics gauges that show a leak."""
        ck = self.checkpoint_slots
        return {
            "kv_blocks_free": self.blocks.num_free, "kv_blocks_capacity": self.blocks.num_blocks,
            "kv_blocks_pinned": len(self.prefix.pinned_blocks), "prefix_cache_checkpoints": ck.num_slots - ck.num_free,
            "state_slots_free": self.slots.num_free, "state_slots_capacity": self.slots.num_slots,
            "checkpoint_slots_free": ck.num_free, "checkpoint_slots_capacity": ck.num_slots,
        }

    @property
    def usage(self) -> float:
        return 1.0 - self.blocks.num_free / max(1, self.blocks.num_blocks)

    def check_empty(self, pinned_blocks: Collection[int] | None = None) -> None:
        """Raise unless no request holds a block or a running slot: the only referenced blocks must be
        `pinned_blocks` (default: the pages prefix checkpoints pin)."""
        pinned = set(self.prefix.pinned_blocks if pinned_blocks is None else pinned_blocks)
        held = {b for b, r in enumerate(self.blocks.ref_cnt) if r != 0}
        if held != pinned:
            extra, missing = sorted(held - pinned), sorted(pinned - held)
            raise AssertionError(f"blocks referenced but not pinned: {extra[:10]}; pinned but free: {missing[:10]}")
        if self.slots.num_free != self.slots.num_slots:
            raise AssertionError(f"state slots leaked: {self.slots.num_slots - self.slots.num_free} not returned")
