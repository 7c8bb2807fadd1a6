"""Hybrid prefix caching: shared MLA pages + KDA state checkpoints (DESIGN.md §5, spec/serving.md §7).

A recurrent state folds in every token, so a hit can resume only where a snapshot of the state exists,
and only if every full page before it is cached too. The pieces:

- **Pages.** A full page is keyed by a chain hash (parent hash, its tokens); the chain starts from a
  root derived from the extra keys (cache salt), so tenants never share. Computed full pages are
  registered in the BlockPool, whose LRU keeps freed pages findable until reused.
- **Checkpoints.** A checkpoint at position p (= p tokens consumed) is a checkpoint slot holding a copy
  of the running slot's conv + recurrent state, plus, when p is not page-aligned, a pinned reference to
  the partial tail page. Rows < p % block_size of that page are never written again (the owner only
  appends), so pinning the owner's block is as good as a copy and costs nothing at snapshot time; a hit
  copies the tail into a fresh page because the new owner appends past p. Checkpoints are never mutated.
- **Lookup** (admission): the longest p <= num_tokens - 1 (the engine must run at least one token to
  sample) at which all p // block_size full pages and a checkpoint exist, in either tier. Walking the
  page chain finds every candidate, so the fallback is the deepest retained checkpoint, never 0.
- **Retention**: prompt end (p = prompt_len - 1, so an identical resend also hits), every
  `prefix_cache_retention_interval` tokens, the branch point of a prefix seen for the second time
  (Marconi's second-hit admission), and the end of the computation (finish, abort, preemption).
  `limit_chunk` ends a prefill chunk exactly at each position; `after_step` snapshots there.
- **Eviction**: pages by the BlockPool's LRU; checkpoints when no checkpoint slot is free, by recency
  plus prefill FLOPs saved per byte (min-max normalized, Marconi). Both spill to the CPU tier if on.

Copies are queued and flushed in batches (`_flush`): before each forward, at the end of each step, and
before any immediate write into a freshly allocated page or slot, so queued reads always see old data.
"""

from __future__ import annotations

import hashlib
import logging
import weakref
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from hyserve.config import EngineConfig
from hyserve.engine.cache_costs import prefill_cost
from hyserve.engine.kv_cache import KVCacheManager
from hyserve.engine.offload import CpuCheckpoint, CpuTier
from hyserve.engine.request import Request
from hyserve.models.batch import to_device
from hyserve.models.config import ModelConfig

log = logging.getLogger(__name__)

_EXTRA_KEY = "prefix_cache"
# weight of FLOPs-saved-per-byte against recency in the checkpoint eviction score (Marconi's alpha)
DEFAULT_ALPHA = 1.0


def _digest(parent: int, tokens: Sequence[int]) -> int:
    data = parent.to_bytes(16, "little") + array("q", tokens).tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=16).digest(), "little")


def root_hash(cache_salt: str | None) -> int:
    """The chain's starting hash: the extra keys every page and checkpoint hash folds in."""
    salt = b"" if cache_salt is None else b"salt:" + cache_salt.encode()
    return int.from_bytes(hashlib.blake2b(b"hyserve-prefix-v1|" + salt, digest_size=16).digest(), "little")


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
    pending: bool = True  # its state copy is still queued


@dataclass
class _ReqCache:
    """Per-request bookkeeping, kept in `req.extra` between admission and finish."""

    root: int
    hashes: list[int] = field(default_factory=list)  # chain hashes of the full pages hashed so far
    registered: int = 0  # full pages registered in the BlockPool
    plan: list[int] = field(default_factory=list)  # positions to snapshot during prefill
    checkpoints: list[int] = field(default_factory=list)  # positions of checkpoints on this chain


class _PrefixRecord:
    """Marconi's "seen" record at page granularity: parent chain hash -> the distinct token runs (up to
    one page) that followed it in earlier sequences. Enough to find the longest common prefix with any
    earlier request to the token. Bounded LRU: forgetting only costs a later second-hit checkpoint."""

    MAX_RUNS = 8

    def __init__(self, max_parents: int):
        self.max_parents = max_parents
        self.runs: OrderedDict[int, list[tuple[int, ...]]] = OrderedDict()

    def branch_point(self, root: int, tokens: list[int], hashes: list[int], bs: int) -> int:
        parent, k = root, 0
        while True:
            runs = self.runs.get(parent)
            if not runs:
                return k * bs
            self.runs.move_to_end(parent)
            run = tuple(tokens[k * bs : (k + 1) * bs])
            if len(run) == bs and run in runs:
                parent, k = hashes[k], k + 1
                continue
            return k * bs + max(_common_prefix(run, r) for r in runs)

    def record(self, root: int, tokens: list[int], hashes: list[int], bs: int) -> None:
        parent = root
        for k in range(-(-len(tokens) // bs)):
            run = tuple(tokens[k * bs : (k + 1) * bs])
            runs = self.runs.setdefault(parent, [])
            self.runs.move_to_end(parent)
            if run not in runs:
                # a longer run supersedes the runs that are its prefixes (a prompt's tail page, extended)
                runs[:] = [r for r in runs if r != run[: len(r)]][-(self.MAX_RUNS - 1) :] + [run]
            if len(run) < bs:
                break
            parent = hashes[k]
        while len(self.runs) > self.max_parents:
            self.runs.popitem(last=False)


def _common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class PrefixCache:
    def __init__(self, cfg: EngineConfig, kv: KVCacheManager, model_config: ModelConfig):
        self.kv, self.bs, self.t = kv, kv.block_size, kv.tensors
        self.interval = cfg.prefix_cache_retention_interval or 0
        self.second_hit = cfg.prefix_cache_second_hit
        self.end_of_generation = cfg.prefix_cache_end_of_generation
        self.cost = prefill_cost(model_config)
        self.alpha = DEFAULT_ALPHA
        self.ckpts: dict[tuple[int, int], Checkpoint] = {}
        self.by_base: dict[int, dict[tuple[int, int], Checkpoint]] = {}
        self.seen = _PrefixRecord(max_parents=max(1024, 4 * kv.blocks.num_blocks))
        self.cpu = CpuTier(cfg.cpu_offload_bytes, kv.tensors) if cfg.cpu_offload_bytes > 0 else None
        kv.blocks.on_evict = weakref.WeakMethod(self._page_evicted)
        self.clock = 0
        # counters (tokens for queries/hits; hits = prefill tokens actually skipped)
        self.queries = self.hits = self.cpu_hits = 0
        self.num_checkpoints_taken = self.num_checkpoint_evictions = self.num_page_evictions = 0
        self._page_out: list[tuple[int, int]] = []  # (block, hash) evicted to the CPU tier
        self._ckpt_out: list[Checkpoint] = []  # evicted to the CPU tier; tail released after the copy
        self._snap: list[tuple[int, int]] = []  # (running slot, checkpoint slot)
        self._snap_ckpts: list[Checkpoint] = []  # the checkpoints those copies fill
        log.info(self.describe())
        if kv.checkpoint_slots.num_slots == 0:
            log.warning("prefix caching is on but there are no checkpoint slots: no KDA prefix can be reused")

    def describe(self) -> str:
        policies = ["prompt-end (prompt_len - 1)"]
        if self.interval:
            policies.append(f"every {self.interval} tokens")
        if self.second_hit:
            policies.append("second-hit branch points")
        if self.end_of_generation:
            policies.append("end of generation")
        cpu = self.cpu.describe() if self.cpu is not None else "CPU tier off"
        return (
            f"prefix caching on: page granularity {self.bs} tokens, checkpoints at any token position; "
            f"{self.kv.blocks.num_blocks} pages, {self.kv.checkpoint_slots.num_slots} checkpoint slots; "
            f"retention: {', '.join(policies)}; {cpu}"
        )

    @property
    def pinned_blocks(self) -> set[int]:
        """The pages checkpoints pin as their tails (what stays referenced once every request is done)."""
        return {c.tail_block for c in self.ckpts.values() if c.tail_block is not None}

    def _page_tensors(self) -> list[torch.Tensor]:
        """Every per-block tensor: a block id covers the MLA rows and, with a DSA indexer, the index keys."""
        return [self.t.pages] if self.t.index_keys is None else [self.t.pages, self.t.index_keys]

    def _copy_block(self, dst: int, src: int) -> None:
        for pt in self._page_tensors():
            pt[dst] = pt[src]

    # ---- scheduler hooks -------------------------------------------------------------------------
    def on_admit(self, req: Request) -> None:
        self._flush()
        rc = _ReqCache(root_hash(req.cache_salt))
        req.extra[_EXTRA_KEY] = rc
        tokens = req.all_token_ids  # prompt, plus outputs when resuming after preemption
        self._hashes(rc, tokens, len(tokens) // self.bs)
        self.queries += len(tokens)
        hit = 0
        if req.params.prompt_logprobs is None and len(tokens) > 1:  # prompt logprobs need every position
            hit = self._hit(req, rc, tokens)
        rc.checkpoints = [hit] if hit else []
        rc.plan = self._plan(req, rc, tokens, hit)
        if self.second_hit:
            self.seen.record(rc.root, tokens, rc.hashes, self.bs)

    def on_admit_failed(self, req: Request) -> None:
        """The scheduler could not give the request its pages: undo the hit (it frees the blocks)."""
        rc = req.extra.pop(_EXTRA_KEY, None)
        self.queries -= req.num_tokens
        self.hits -= req.num_computed_tokens
        req.num_cached_tokens = 0
        if rc is not None and req.num_computed_tokens:
            req.fresh_state = True

    def limit_chunk(self, req: Request, n: int) -> int:
        rc = req.extra.get(_EXTRA_KEY)
        if rc is None:
            return n
        start, end = req.num_computed_tokens, req.num_computed_tokens + n
        stops = [q for q in rc.plan if start < q < end]
        if self.interval:
            q = (start // self.interval + 1) * self.interval
            if q < end:
                stops.append(q)
        return min(stops) - start if stops else n

    def before_step(self, out) -> None:
        self._flush()

    def after_step(self, out) -> None:
        for s in out.seqs:
            req = s.req
            rc = req.extra.get(_EXTRA_KEY)
            if rc is None or req.state_slot is None or req.is_finished:
                continue  # finished ones were handled in on_finish
            if req.num_known_tokens < req.num_computed_tokens:
                continue  # async scheduling: a computed token's id is still on the device
            p = req.num_computed_tokens
            want = self._wants(rc, p)
            if want or p // self.bs > rc.registered:
                tokens = req.all_token_ids
                self._register(req, rc, tokens)
                if want:
                    self._snapshot(req, rc, p, tokens)
        self._flush()

    def on_finish(self, req: Request) -> None:
        """Finish, abort or preemption, before the request's pages and slot are freed."""
        rc = req.extra.pop(_EXTRA_KEY, None)
        if rc is None or req.state_slot is None or req.fresh_state:
            return
        if req.num_known_tokens < req.num_computed_tokens:
            return  # preempted or aborted with a token in flight: the blocks' last ids are not known yet
        p, tokens = req.num_computed_tokens, req.all_token_ids
        self._register(req, rc, tokens)
        if p > 0 and (self.end_of_generation or self._wants(rc, p)):
            self._snapshot(req, rc, p, tokens)
        if self.second_hit:
            self._hashes(rc, tokens, len(tokens) // self.bs)
            self.seen.record(rc.root, tokens, rc.hashes, self.bs)

    # ---- lookup and hit --------------------------------------------------------------------------
    def _hit(self, req: Request, rc: _ReqCache, tokens: list[int]) -> int:
        """Apply the longest hit; if the pages to load from the CPU tier cannot be allocated, the longest
        hit that needs none. Returns the tokens skipped."""
        for gpu_only in (False, True):
            found = self._lookup(rc, tokens, len(tokens) - 1, gpu_only)
            if found is None:
                return 0
            ck, blocks = found
            if self._apply(req, rc, ck, blocks):
                return ck.p
            if all(b is not None for b in blocks):
                return 0  # nothing to trade away: the pool cannot even hold the tail page
        return 0

    def _lookup(
        self, rc: _ReqCache, tokens: list[int], limit: int, gpu_only: bool,
    ) -> tuple[Checkpoint | CpuCheckpoint, list[int | None]] | None:
        """Walk the page chain as far as pages exist (GPU block id, or None = in the CPU tier) and keep the
        deepest checkpoint whose pages are all present."""
        bs, pool = self.bs, self.kv.blocks
        best, blocks, base, k = None, [], rc.root, 0
        while True:
            groups = [self.by_base.get(base, {}).values()]
            if self.cpu is not None:
                groups.append(self.cpu.checkpoints_at(base))
            for group in groups:  # GPU first: it wins ties
                for c in group:
                    if c.p <= limit and (best is None or c.p > best.p) and c.key == self._key(base, tokens, c.p):
                        best = c
            if (k + 1) * bs > limit:
                break
            b = pool.lookup(rc.hashes[k])
            if b is None and (gpu_only or self.cpu is None or not self.cpu.has_page(rc.hashes[k])):
                break
            blocks.append(b)
            base, k = rc.hashes[k], k + 1
        if best is None:
            return None
        return best, blocks[: best.p // bs]

    def _key(self, base: int, tokens: list[int], p: int) -> tuple[int, int]:
        start = p - p % self.bs
        return (_digest(base, tokens[start:p]) if p > start else base, p)

    def _apply(self, req: Request, rc: _ReqCache, ck: Checkpoint | CpuCheckpoint, blocks: list[int | None]) -> bool:
        pool, t, dev = self.kv.blocks, self.t, self.t.pages.device
        for b in blocks:  # take the GPU pages first so the allocation below cannot evict them
            if b is not None:
                pool.touch(b)
        missing = [i for i, b in enumerate(blocks) if b is None]
        has_tail = ck.p % self.bs != 0
        new = pool.allocate(len(missing) + has_tail)
        if new is None:
            pool.free([b for b in blocks if b is not None])
            return False
        self._flush()  # pages that allocation evicted leave for the CPU tier before we overwrite them
        ids = list(blocks)
        if missing:
            hashes = [rc.hashes[i] for i in missing]
            dst = new[: len(missing)]
            rows = torch.tensor(dst, device=dev)
            for pt, data in zip(self._page_tensors(), self.cpu.gather_pages(hashes)):
                pt.index_copy_(0, rows, data.to(dev))
            for i, b, h in zip(missing, dst, hashes):
                ids[i] = b
                pool.set_hash(b, h)
        if isinstance(ck, Checkpoint):
            if has_tail:
                self._copy_block(new[-1], ck.tail_block)
            t.conv[req.state_slot] = t.conv[ck.slot]
            t.recurrent[req.state_slot] = t.recurrent[ck.slot]
            self.clock += 1
            ck.last_use = self.clock
        else:
            conv, rec, tail = self.cpu.read_checkpoint(ck)
            if has_tail:
                for pt, row in zip(self._page_tensors(), tail):
                    pt[new[-1]] = row.to(dev)
            t.conv[req.state_slot] = conv.to(dev)
            t.recurrent[req.state_slot] = rec.to(dev)
            self.cpu_hits += ck.p
            req.extra["external_cached_tokens"] = ck.p
        if has_tail:
            ids.append(new[-1])
        req.block_ids = ids
        req.num_computed_tokens = req.num_cached_tokens = ck.p
        req.fresh_state = False
        rc.registered = ck.p // self.bs
        self.hits += ck.p
        return True

    # ---- retention -------------------------------------------------------------------------------
    def _plan(self, req: Request, rc: _ReqCache, tokens: list[int], hit: int) -> list[int]:
        plan = set()
        end = req.num_prompt_tokens - 1
        if end > hit:
            plan.add(end)
        if self.second_hit:
            # Marconi: a prefix shared with an earlier request gets its state at the branch point. Only
            # when it saves at least a page over the hit: chat templates share a few tokens with everyone.
            branch = min(self.seen.branch_point(rc.root, tokens, rc.hashes, self.bs), len(tokens) - 1)
            if branch - hit >= self.bs:
                plan.add(branch)
        return sorted(plan)

    def _wants(self, rc: _ReqCache, p: int) -> bool:
        return p > 0 and (p in rc.plan or (self.interval > 0 and p % self.interval == 0))

    def _register(self, req: Request, rc: _ReqCache, tokens: list[int]) -> None:
        n = req.num_computed_tokens // self.bs
        if n <= rc.registered:
            return
        self._hashes(rc, tokens, n)
        for i in range(rc.registered, n):
            self.kv.blocks.set_hash(req.block_ids[i], rc.hashes[i])
        rc.registered = n

    def _hashes(self, rc: _ReqCache, tokens: list[int], n: int) -> None:
        bs = self.bs
        for k in range(len(rc.hashes), n):
            rc.hashes.append(_digest(rc.hashes[-1] if k else rc.root, tokens[k * bs : (k + 1) * bs]))

    def _snapshot(self, req: Request, rc: _ReqCache, p: int, tokens: list[int]) -> None:
        """Checkpoint the running slot at p = req.num_computed_tokens (the copy is queued)."""
        k = p // self.bs
        self._hashes(rc, tokens, k)
        base = rc.hashes[k - 1] if k else rc.root
        key = self._key(base, tokens, p)
        self.clock += 1
        if key in self.ckpts:
            self.ckpts[key].last_use = self.clock
            return
        if self.cpu is not None and self.cpu.has_checkpoint(key):
            return
        slot = self.kv.checkpoint_slots.allocate()
        if slot is None:
            slot = self._evict_checkpoint()
            if slot is None:
                return
        tail = None
        if p % self.bs:
            tail = req.block_ids[k]
            self.kv.blocks.touch(tail)
        parent = max((q for q in rc.checkpoints if q < p), default=0)
        nbytes = self.kv.plan.slot_bytes + (self.kv.plan.page_bytes if tail is not None else 0)
        c = Checkpoint(key, base, p, slot, tail, self.cost.saved(parent, p), nbytes, self.clock)
        self.ckpts[key] = c
        self.by_base.setdefault(base, {})[key] = c
        rc.checkpoints.append(p)
        self._snap.append((req.state_slot, slot))
        self._snap_ckpts.append(c)
        self.num_checkpoints_taken += 1

    # ---- eviction --------------------------------------------------------------------------------
    def release_pinned_page(self) -> bool:
        """Page pressure: drop the lowest-scored checkpoint that pins a tail page, so the page can return
        to the pool before the scheduler preempts or fails a request. False when no checkpoint pins one."""
        slot = self._evict_checkpoint(pins_page=True)
        if slot is None:
            return False
        self._flush()  # with the CPU tier the tail is released only after its copy-out
        self.kv.checkpoint_slots.free(slot)
        return True

    def _evict_checkpoint(self, pins_page: bool = False) -> int | None:
        """Drop the checkpoint with the lowest recency + FLOPs-per-byte score; returns its slot. Nothing
        running depends on a checkpoint: a hit copies it at admission."""
        cands = [c for c in self.ckpts.values() if not c.pending and (c.tail_block is not None or not pins_page)]
        if not cands and self._snap:
            self._flush()
            cands = [c for c in self.ckpts.values() if c.tail_block is not None or not pins_page]
        if not cands:
            return None
        victim = min(cands, key=self._scorer(cands))
        self._unindex(victim)
        self.num_checkpoint_evictions += 1
        if self.cpu is not None:
            self._ckpt_out.append(victim)  # its slot is reused right away: the copy-out is queued first
        elif victim.tail_block is not None:
            self.kv.blocks.free([victim.tail_block])
        return victim.slot

    def discard(self, c: Checkpoint) -> None:
        """Drop a GPU checkpoint without spilling it (its slot and tail page are released)."""
        self._flush()
        self._unindex(c)
        if c.tail_block is not None:
            self.kv.blocks.free([c.tail_block])
        self.kv.checkpoint_slots.free(c.slot)

    def _unindex(self, c: Checkpoint) -> None:
        del self.ckpts[c.key]
        group = self.by_base[c.base]
        del group[c.key]
        if not group:
            del self.by_base[c.base]

    def _scorer(self, cands: list[Checkpoint]):
        eff = [c.flops_saved / c.nbytes for c in cands]
        rec = [c.last_use for c in cands]
        e_lo, e_span = min(eff), (max(eff) - min(eff)) or 1.0
        r_lo, r_span = min(rec), (max(rec) - min(rec)) or 1.0
        return lambda c: self.alpha * (c.flops_saved / c.nbytes - e_lo) / e_span + (c.last_use - r_lo) / r_span

    def _page_evicted(self, block: int, h: int) -> None:
        self.num_page_evictions += 1
        if self.cpu is not None and not self.cpu.has_page(h):
            self._page_out.append((block, h))

    # ---- batched copies --------------------------------------------------------------------------
    def _flush(self) -> None:
        """Run the queued copies, reads of old contents before the writes that reuse them."""
        t, dev = self.t, self.t.pages.device
        if self._page_out:
            blocks = torch.tensor([b for b, _ in self._page_out], device=dev)
            self.cpu.put_pages([h for _, h in self._page_out], [pt.index_select(0, blocks) for pt in self._page_tensors()])
            self._page_out.clear()
        if self._ckpt_out:
            out, self._ckpt_out = self._ckpt_out, []
            slots = torch.tensor([c.slot for c in out], device=dev)
            tails = [c.tail_block for c in out if c.tail_block is not None]
            tail_ids = torch.tensor(tails, device=dev, dtype=torch.long)
            tail_data = [pt.index_select(0, tail_ids) for pt in self._page_tensors()]
            self.cpu.put_checkpoints(
                [(c.key, c.base, c.p, c.flops_saved) for c in out], t.conv.index_select(0, slots),
                t.recurrent.index_select(0, slots), tail_data, [c.tail_block is not None for c in out],
            )
            if tails:
                self.kv.blocks.free(tails)
        if self._snap:
            src = to_device([s for s, _ in self._snap], torch.long, dev)  # no stream sync (async scheduling)
            dst = to_device([d for _, d in self._snap], torch.long, dev)
            t.conv.index_copy_(0, dst, t.conv.index_select(0, src))
            t.recurrent.index_copy_(0, dst, t.recurrent.index_select(0, src))
            self._snap.clear()
            for c in self._snap_ckpts:
                c.pending = False
            self._snap_ckpts.clear()
