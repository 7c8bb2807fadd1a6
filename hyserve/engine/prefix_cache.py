"""Hybrid prefix caching: shared MLA pages + KDA state checkpoints (docs/ARCHITECTURE.md, "Prefix cache").

A recurrent state folds in every token, so a hit can resume only where a snapshot of the state exists,
and only if every full page before it is cached too. The pieces:

- **Pages.** A full page is keyed by a chain hash (parent hash, its tokens); the chain starts from a
  root derived from the extra keys (cache salt), so tenants never share. Computed full pages are
  registered in the BlockPool, whose LRU keeps freed pages findable until reused.
- **Checkpoints** (checkpoints.py): the KDA state at a position, plus a pinned partial tail page; a hit
  copies the tail into a fresh page because the new owner appends past the position.
- **Lookup** (admission): the longest p <= num_tokens - 1 (the engine must run at least one token to
  sample) at which all p // block_size full pages and a checkpoint exist, in either tier. Walking the
  page chain finds every candidate, so the fallback is the deepest retained checkpoint, never 0.
- **Retention**: prompt end (p = prompt_len - 1, so an identical resend also hits), every
  `prefix_cache_retention_interval` tokens, the branch point of a prefix seen for the second time
  (Marconi's second-hit admission), and the end of the computation (finish, abort, preemption).
  `limit_chunk` ends a prefill chunk exactly at each position; `cache_blocks` snapshots there.
- **Eviction**: pages by the BlockPool's LRU, checkpoints by their store; both spill to the CPU tier
  if on. The pool records the cached pages it reuses; `flush` copies them out before anything writes.
- **Copies** are queued and flushed in batches (before each forward, at the end of each step, before
  any immediate write into a fresh page or slot), so queued reads always see old data.

`NoPrefixCache` is the interface with caching off. Neither writes a request's fields: the cache manager
does, from what they return.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from hyserve.config import EngineConfig
from hyserve.engine.block_pool import BlockPool, SlotPool
from hyserve.engine.checkpoints import Checkpoint, CheckpointStore
from hyserve.engine.offload import CpuCheckpoint, CpuTier
from hyserve.engine.request import Request
from hyserve.models.batch import CacheTensors
from hyserve.models.config import ModelConfig
from hyserve.models.costs import prefill_cost

log = logging.getLogger(__name__)


def _digest(parent: int, tokens: Sequence[int]) -> int:
    data = parent.to_bytes(16, "little") + array("q", tokens).tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=16).digest(), "little")


def root_hash(cache_salt: str | None) -> int:
    """The chain's starting hash: the extra keys every page and checkpoint hash folds in."""
    salt = b"" if cache_salt is None else b"salt:" + cache_salt.encode()
    return int.from_bytes(hashlib.blake2b(b"hyserve-prefix-v1|" + salt, digest_size=16).digest(), "little")


@dataclass(frozen=True)
class PrefixHit:
    """What a lookup found: resume after `num_tokens` tokens from `checkpoint`, over the full pages
    `blocks` (a GPU block id, or None for a page held by the CPU tier)."""

    num_tokens: int = 0
    checkpoint: Checkpoint | CpuCheckpoint | None = None
    blocks: tuple[int | None, ...] = ()

    @property
    def external(self) -> bool:
        """Restored from the CPU tier (vLLM's "external" prefix cache hits)."""
        return isinstance(self.checkpoint, CpuCheckpoint)

    @property
    def needs_cpu(self) -> bool:
        return self.external or None in self.blocks


NO_HIT = PrefixHit()


@dataclass
class _Chain:
    """A request's hashing and retention state, from its first lookup until it is freed."""

    root: int
    hashes: list[int] = field(default_factory=list)  # chain hashes of the full pages hashed so far
    registered: int = 0  # full pages registered in the BlockPool
    plan: list[int] = field(default_factory=list)  # positions to snapshot during prefill
    checkpoints: list[int] = field(default_factory=list)  # positions of checkpoints on this chain
    serial: int = 0  # the owner its checkpoints record
    newest: Checkpoint | None = None  # what the request would resume from (its hit, then its latest snapshot)


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
            return k * bs + max(len(os.path.commonprefix([run, r])) for r in runs)

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


class NoPrefixCache:
    """Prefix caching off: every lookup misses, nothing is registered or retained. The interface, in the
    order the cache manager calls it: `find` a waiting request's hit; `load` it into the request's slot
    and new pages; `start` the admission (plan the checkpoints); `limit_chunk` a chunk to end at one;
    `admitted` (count it); `cache_blocks` after a step; `retain` (or `forget`) before a request's pages
    and slot are freed; `release_pinned_page` under page pressure; `flush` the queued copies."""

    queries = hits = 0
    pinned_blocks: frozenset[int] = frozenset()

    def find(self, req: Request, gpu_only: bool = False) -> PrefixHit:
        return NO_HIT

    def start(self, req: Request, hit: PrefixHit) -> None: ...

    def admitted(self, req: Request, hit: PrefixHit) -> None: ...

    def limit_chunk(self, req: Request, n: int) -> int:
        return n

    def cache_blocks(self, seqs) -> None: ...

    def retain(self, req: Request) -> None: ...

    def forget(self, req: Request) -> None: ...

    def release_pinned_page(self) -> bool:
        return False

    def flush(self) -> None: ...


class PrefixCache(NoPrefixCache):
    def __init__(self, cfg: EngineConfig, blocks: BlockPool, checkpoint_slots: SlotPool, tensors: CacheTensors,
                 block_size: int, slot_bytes: int, page_bytes: int, model_config: ModelConfig):
        self.blocks, self.bs, self.t = blocks, block_size, tensors
        self.slot_bytes, self.page_bytes = slot_bytes, page_bytes
        self.interval = cfg.prefix_cache_retention_interval or 0
        self.second_hit = cfg.prefix_cache_second_hit
        self.end_of_generation = cfg.prefix_cache_end_of_generation
        self.cost = prefill_cost(model_config)
        # every per-block tensor: a block id covers the MLA rows and, with a DSA indexer, the index keys
        self.rows = tensors.block_tensors
        self.cpu = CpuTier(cfg.cpu_offload_bytes, tensors) if cfg.cpu_offload_bytes > 0 else None
        self.last_full_page = cfg.prefix_cache_last_full_page
        self._chains: dict[Request, _Chain] = (chains := {})  # the lambda below holds this, not self: no cycle
        self.checkpoints = CheckpointStore(checkpoint_slots, blocks, tensors, self.rows, self.cpu,
                                           lambda: {c.newest for c in chains.values()} - {None})
        self.seen = _PrefixRecord(max_parents=max(1024, 4 * blocks.num_blocks))
        self._serials = itertools.count(1)
        # counters (tokens for queries/hits; hits = prefill tokens actually skipped)
        self.queries = self.hits = self.cpu_hits = self.num_page_evictions = 0
        log.info(self.describe())
        if checkpoint_slots.num_slots == 0:
            log.warning("prefix caching is on but there are no checkpoint slots: no KDA prefix can be reused")

    def describe(self) -> str:
        policies = ["prompt-end (prompt_len - 1)"] + ["the prompt's last full page"] * self.last_full_page
        if self.interval:
            policies.append(f"every {self.interval} tokens")
        if self.second_hit:
            policies.append("second-hit branch points")
        if self.end_of_generation:
            policies.append("end of generation")
        cpu = self.cpu.describe() if self.cpu is not None else "CPU tier off"
        return (
            f"prefix caching on: page granularity {self.bs} tokens, checkpoints at any token position; "
            f"{self.blocks.num_blocks} pages, {self.checkpoints.slots.num_slots} checkpoint slots; "
            f"retention: {', '.join(policies)}; {cpu}"
        )

    @property
    def pinned_blocks(self) -> set[int]:
        return self.checkpoints.pinned_blocks

    # ---- lookup and hit --------------------------------------------------------------------------
    def find(self, req: Request, gpu_only: bool = False) -> PrefixHit:
        """The longest hit for req's known tokens (the prompt, plus outputs when resuming after a
        preemption); `gpu_only`: one that needs nothing from the CPU tier."""
        chain = self._chains.get(req)
        if chain is None:
            chain = self._chains[req] = _Chain(root_hash(req.cache_salt), serial=next(self._serials))
        tokens = req.all_token_ids
        self._hashes(chain, tokens, len(tokens) // self.bs)
        if req.params.prompt_logprobs is not None or len(tokens) < 2:  # prompt logprobs need every position
            return NO_HIT
        bs, pool, limit = self.bs, self.blocks, len(tokens) - 1
        best, blocks, base, k = None, [], chain.root, 0
        while True:
            groups = [self.checkpoints.at(base)]
            if self.cpu is not None:
                groups.append(self.cpu.checkpoints_at(base))
            for group in groups:  # GPU first: it wins ties
                for c in group:
                    if c.p <= limit and (best is None or c.p > best.p) and c.key == self._key(base, tokens, c.p):
                        best = c
            if (k + 1) * bs > limit:
                break
            b = pool.lookup(chain.hashes[k])
            if b is None and (gpu_only or self.cpu is None or not self.cpu.has_page(chain.hashes[k])):
                break
            blocks.append(b)
            base, k = chain.hashes[k], k + 1
        return NO_HIT if best is None else PrefixHit(best.p, best, tuple(blocks[: best.p // bs]))

    def _key(self, base: int, tokens: list[int], p: int) -> tuple[int, int]:
        start = p - p % self.bs
        return (_digest(base, tokens[start:p]) if p > start else base, p)

    def load(self, req: Request, hit: PrefixHit, slot: int) -> list[int] | None:
        """Put the hit in place for running `slot`: its GPU pages referenced, its CPU-tier pages and its
        tail page copied into new blocks, its state copied into the slot. Returns the block table that
        covers hit.num_tokens, or None (nothing taken) when the pool cannot hold the new blocks."""
        pool, t, ck, dev = self.blocks, self.t, hit.checkpoint, self.t.pages.device
        for b in hit.blocks:  # take the GPU pages first so the allocation below cannot evict them
            if b is not None:
                pool.touch(b)
        missing = [i for i, b in enumerate(hit.blocks) if b is None]
        has_tail = ck.p % self.bs != 0
        new = pool.allocate(len(missing) + has_tail)
        if new is None:
            pool.free([b for b in hit.blocks if b is not None])
            return None
        self.flush()  # pages that allocation evicted leave for the CPU tier before we overwrite them
        ids = list(hit.blocks)
        if missing:
            hashes = [self._chains[req].hashes[i] for i in missing]
            rows = torch.tensor(new[: len(missing)], device=dev)
            for pt, data in zip(self.rows, self.cpu.gather_pages(hashes)):
                pt.index_copy_(0, rows, data.to(dev))
            for i, b, h in zip(missing, new, hashes):
                ids[i] = b
                pool.set_hash(b, h)
        if hit.external:
            conv, rec, tail = self.cpu.read_checkpoint(ck)
            t.conv[slot], t.recurrent[slot] = conv.to(dev), rec.to(dev)
            for pt, row in zip(self.rows, tail if has_tail else ()):
                pt[new[-1]] = row.to(dev)
        else:  # through the cache tensors' copies, which every rank of a parallel layout applies
            self.checkpoints.used(ck)
            t.copy_slots([ck.slot], [slot])
            if has_tail:
                t.copy_blocks([ck.tail_block], [new[-1]])
        return ids + [new[-1]] if has_tail else ids

    def start(self, req: Request, hit: PrefixHit) -> None:
        chain, tokens, p = self._chains[req], req.all_token_ids, hit.num_tokens
        chain.registered = p // self.bs
        chain.checkpoints = [p] if p else []
        plan = set()
        if req.num_prompt_tokens - 1 > p:
            plan.add(req.num_prompt_tokens - 1)
        if self.last_full_page and req.num_prompt_tokens // self.bs * self.bs > p:
            plan.add(req.num_prompt_tokens // self.bs * self.bs)  # where a prompt sharing only its pages resumes
        if self.second_hit:
            # Marconi: a prefix shared with an earlier request gets its state at the branch point. Only
            # when it saves at least a page over the hit: chat templates share a few tokens with everyone.
            branch = min(self.seen.branch_point(chain.root, tokens, chain.hashes, self.bs), len(tokens) - 1)
            if branch - p >= self.bs:
                plan.add(branch)
        chain.plan = sorted(plan)

    def admitted(self, req: Request, hit: PrefixHit) -> None:
        chain, tokens = self._chains[req], req.all_token_ids
        self.queries += len(tokens)
        self.hits += hit.num_tokens
        self.cpu_hits += hit.num_tokens if hit.external else 0
        if isinstance(hit.checkpoint, Checkpoint):
            chain.newest = hit.checkpoint
            self.checkpoints.resume(hit.checkpoint)
        if self.second_hit:
            self.seen.record(chain.root, tokens, chain.hashes, self.bs)

    # ---- retention -------------------------------------------------------------------------------
    def limit_chunk(self, req: Request, n: int) -> int:
        chain = self._chains.get(req)
        if chain is None:
            return n
        start, end = req.num_computed_tokens, req.num_computed_tokens + n
        stops = [q for q in chain.plan if start < q < end]
        if self.interval:
            q = (start // self.interval + 1) * self.interval
            if q < end:
                stops.append(q)
        return min(stops) - start if stops else n

    def _wants(self, chain: _Chain, p: int) -> bool:
        return p > 0 and (p in chain.plan or (self.interval > 0 and p % self.interval == 0))

    def cache_blocks(self, seqs) -> None:
        for s in seqs:
            req = s.req
            chain = self._chains.get(req)
            if chain is None or req.state_slot is None or req.is_finished:
                continue  # finished ones were handled in retain
            if req.num_known_tokens < req.num_computed_tokens:
                continue  # async scheduling: a computed token's id is still on the device
            p = req.num_computed_tokens
            want = self._wants(chain, p)
            if want or p // self.bs > chain.registered:
                tokens = req.all_token_ids
                self._register(req, chain, tokens)
                if want:
                    self._snapshot(req, chain, p, tokens)
        self.flush()

    def retain(self, req: Request) -> None:
        chain = self._chains.pop(req, None)
        if chain is None or req.state_slot is None or req.fresh_state:
            return
        if req.num_known_tokens < req.num_computed_tokens:
            return  # preempted or aborted with a token in flight: the blocks' last ids are not known yet
        p, tokens = req.num_computed_tokens, req.all_token_ids
        self._register(req, chain, tokens)
        if p > 0 and (self.end_of_generation or self._wants(chain, p)):
            self._snapshot(req, chain, p, tokens)
        if self.second_hit:
            self._hashes(chain, tokens, len(tokens) // self.bs)
            self.seen.record(chain.root, tokens, chain.hashes, self.bs)

    def forget(self, req: Request) -> None:
        self._chains.pop(req, None)

    def _register(self, req: Request, chain: _Chain, tokens: list[int]) -> None:
        n = req.num_computed_tokens // self.bs
        if n <= chain.registered:
            return
        self._hashes(chain, tokens, n)
        for i in range(chain.registered, n):
            self.blocks.set_hash(req.block_ids[i], chain.hashes[i])
        chain.registered = n

    def _hashes(self, chain: _Chain, tokens: list[int], n: int) -> None:
        bs = self.bs
        for k in range(len(chain.hashes), n):
            chain.hashes.append(_digest(chain.hashes[-1] if k else chain.root, tokens[k * bs : (k + 1) * bs]))

    def _snapshot(self, req: Request, chain: _Chain, p: int, tokens: list[int]) -> None:
        """Checkpoint the running slot at p = req.num_computed_tokens (the copy is queued)."""
        k = p // self.bs
        self._hashes(chain, tokens, k)
        base = chain.hashes[k - 1] if k else chain.root
        tail = req.block_ids[k] if p % self.bs else None
        parent = max((q for q in chain.checkpoints if q < p), default=0)
        nbytes = self.slot_bytes + (self.page_bytes if tail is not None else 0)
        c = self.checkpoints.take(req.state_slot, self._key(base, tokens, p), base, p, tail, self.cost.saved(parent, p),
                                  nbytes, chain.serial, p >= req.num_prompt_tokens // self.bs * self.bs, chain.newest)
        if c is not None:
            chain.checkpoints.append(p)
            chain.newest = c

    # ---- eviction and copies ---------------------------------------------------------------------
    def release_pinned_page(self) -> bool:
        return self.checkpoints.release_pinned_page()

    def flush(self) -> None:
        """Copy the cached pages the pool reused out to the CPU tier, then the checkpoints' copies."""
        evicted = self.blocks.take_evicted()
        self.num_page_evictions += len(evicted)
        if self.cpu is not None:
            out = [(b, h) for b, h in evicted if not self.cpu.has_page(h)]
            if out:
                blocks = torch.tensor([b for b, _ in out], device=self.t.pages.device)
                self.cpu.put_pages([h for _, h in out], [pt.index_select(0, blocks) for pt in self.rows])
        self.checkpoints.flush()
