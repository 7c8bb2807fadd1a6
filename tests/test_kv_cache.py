"""The page pool, the state-slot pool and the cache manager over them: all-or-nothing allocation, LRU
reuse of cached pages (reported, not called back), leaks."""

from __future__ import annotations

import pytest

from hyserve.config import EngineConfig
from hyserve.engine.block_pool import BlockPool, SlotPool
from hyserve.engine.kv_cache import CachePlan, KVCacheManager
from hyserve.engine.prefix_cache import NO_HIT
from hyserve.engine.request import Request
from hyserve.engine.scheduler import ScheduledSeq, SchedulerOutput
from hyserve.sampling_params import SamplingParams


def request() -> Request:
    return Request("r", [1, 2, 3], SamplingParams(), max_tokens=4)


def computed(kv: KVCacheManager, req: Request, n: int) -> None:
    """What a launched step of n tokens does to the request's computed count."""
    kv.begin_step(SchedulerOutput([ScheduledSeq(req, n, req.num_computed_tokens)]))


@pytest.fixture
def kv(tiny_model) -> KVCacheManager:
    model, _ = tiny_model("k3-tiny")
    plan = CachePlan(num_blocks=8, num_slots=4, num_checkpoint_slots=2, block_size=16, page_bytes=1, slot_bytes=1)
    return KVCacheManager(EngineConfig(model="k3-tiny", enable_prefix_caching=False), model, plan, model.dtype)


def test_allocation_is_all_or_nothing():
    pool = BlockPool(4)
    assert pool.allocate(5) is None and pool.num_free == 4
    assert sorted(pool.allocate(4)) == [0, 1, 2, 3] and pool.num_free == 0


def test_freeing_a_block_twice_raises():
    pool = BlockPool(2)
    blocks = pool.allocate(1)
    pool.free(blocks)
    with pytest.raises(RuntimeError, match="freed twice"):
        pool.free(blocks)


def test_a_freed_cached_block_stays_findable_until_reused():
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    pool.set_hash(a, 123)
    pool.free([a, b])
    assert pool.lookup(123) == a
    assert pool.allocate(1) == [b]  # unhashed blocks are reused first
    assert pool.lookup(123) == a and pool.take_evicted() == []
    assert pool.allocate(1) == [a] and pool.lookup(123) is None
    assert pool.take_evicted() == [(a, 123)] and pool.take_evicted() == []  # the owner spills it, once


def test_touching_a_free_cached_block_takes_it_off_the_free_queue():
    pool = BlockPool(2)
    a, _ = pool.allocate(2)
    pool.set_hash(a, 7)
    pool.free([a])
    pool.touch(a)
    assert pool.num_free == 0 and pool.ref_cnt[a] == 1


def test_a_shared_block_returns_to_the_pool_after_its_last_reference():
    pool = BlockPool(1)
    (a,) = pool.allocate(1)
    pool.touch(a)
    pool.free([a])
    assert pool.num_free == 0
    pool.free([a])
    assert pool.num_free == 1


def test_slot_pool_hands_out_each_slot_once():
    slots = SlotPool(2, 4)
    got = {slots.allocate(), slots.allocate()}
    assert got == {2, 3} and slots.allocate() is None
    slots.free(2)
    assert slots.allocate() == 2


def test_a_block_table_grows_to_cover_the_tokens(kv):
    req = request()
    assert kv.allocate_slots(req, 17, NO_HIT) == 17 and len(req.block_ids) == 2
    computed(kv, req, 17)
    assert kv.allocate_slots(req, 15) == 15 and len(req.block_ids) == 2
    assert kv.allocate_slots(req, 16) == 16 and len(req.block_ids) == 3
    kv.free(req)


def test_a_failed_allocation_leaves_the_block_table_unchanged(kv):
    req = request()
    assert kv.allocate_slots(req, 16, NO_HIT) == 16
    computed(kv, req, 16)
    assert kv.allocate_slots(req, 16 * 8) == 0
    assert len(req.block_ids) == 1 and kv.blocks.num_free == 7
    kv.free(req)


def test_a_failed_admission_takes_nothing(kv):
    req = request()
    assert kv.allocate_slots(req, 16 * 9, NO_HIT) == 0
    assert req.block_ids == [] and req.state_slot is None and req.num_computed_tokens == 0
    kv.check_empty()


def test_running_slots_and_checkpoint_slots_are_disjoint(kv):
    running = {kv.slots.allocate() for _ in range(kv.slots.num_slots)}
    ckpts = {kv.checkpoint_slots.allocate() for _ in range(kv.checkpoint_slots.num_slots)}
    assert running == {0, 1} and ckpts == {2, 3}


def test_free_returns_pages_and_slot(kv):
    req = request()
    assert kv.allocate_slots(req, 40, NO_HIT) and req.state_slot is not None
    computed(kv, req, 40)
    kv.free(req)
    assert req.block_ids == [] and req.state_slot is None and req.num_computed_tokens == 0 and req.fresh_state
    kv.check_empty()


def test_check_empty_reports_a_leaked_page(kv):
    req = request()
    kv.allocate_slots(req, 1, NO_HIT)
    with pytest.raises(AssertionError, match="referenced"):
        kv.check_empty()
    kv.free(req)


def test_check_empty_reports_a_leaked_slot(kv):
    slot = kv.slots.allocate()
    with pytest.raises(AssertionError, match="slots leaked"):
        kv.check_empty()
    kv.slots.free(slot)


def test_check_empty_accepts_exactly_the_pinned_pages(kv):
    (b,) = kv.blocks.allocate(1)
    kv.check_empty(pinned_blocks={b})
    with pytest.raises(AssertionError, match="referenced but not pinned"):
        kv.check_empty()
    with pytest.raises(AssertionError, match="pinned but free"):
        kv.check_empty(pinned_blocks={b, b + 1})
    kv.blocks.free([b])
