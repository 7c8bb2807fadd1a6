"""Scheduler policy on a real (tiny) cache: one token budget, running first, chunking, preemption, priority."""

from __future__ import annotations

from hyserve import SamplingParams
from hyserve.engine.request import RequestStatus

LONG = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


def add(engine, rid: str, n_prompt: int, params: SamplingParams = LONG, **kw):
    engine.add_request(rid, list(range(1, n_prompt + 1)), params, **kw)
    return engine.parents[rid].children[0]


def drain(engine) -> list[str]:
    """Step to completion; returns request ids in finishing order."""
    order = []
    while engine.has_unfinished_requests():
        order += [o.request_id for o in engine.step() if o.finished]
    return order


def test_a_step_never_exceeds_the_token_budget(make_engine):
    engine = make_engine(max_num_batched_tokens=20)
    for i in range(4):
        add(engine, str(i), 30)
    while engine.has_unfinished_requests():
        out = engine.scheduler.schedule()
        assert out.num_tokens <= 20
        engine.kv.begin_step(out)  # complete the step by hand: the budget is what is under test
        for s in out.seqs:
            if s.samples:
                s.req.output_token_ids.append(1)
                if len(s.req.output_token_ids) >= 3:
                    engine.abort_request(s.req.request_id)


def test_a_long_prompt_is_prefilled_in_budget_sized_chunks(make_engine):
    engine = make_engine(max_num_batched_tokens=16, enable_prefix_caching=False)
    req = add(engine, "r", 40)
    progress = []
    while not req.output_token_ids:
        engine.step()
        progress.append(req.num_computed_tokens)
    assert progress == [16, 32, 40]
    drain(engine)


def test_running_requests_are_scheduled_before_waiting_ones(make_engine):
    engine = make_engine(max_num_batched_tokens=8, enable_prefix_caching=False)
    first = add(engine, "first", 4)
    engine.step()  # first's whole prompt fits: it now decodes
    add(engine, "second", 30)
    out = engine.scheduler.schedule()
    assert out.seqs[0].req is first and out.seqs[0].num_new_tokens == 1
    assert out.seqs[1].num_new_tokens == 7  # the waiting prefill gets what the decode left
    engine.abort_request("first")
    engine.abort_request("second")


def test_max_num_seqs_caps_the_running_set(make_engine):
    engine = make_engine(max_num_seqs=2)
    for i in range(5):
        add(engine, str(i), 5)
    engine.step()
    assert len(engine.scheduler.running) == 2 and len(engine.scheduler.waiting) == 3
    drain(engine)


def test_preemption_evicts_the_latest_arrival_and_requeues_it_first(make_engine):
    engine = make_engine(num_gpu_blocks=5, enable_prefix_caching=False)  # 80 cache tokens
    old = add(engine, "old", 30, arrival_time=1.0)
    new = add(engine, "new", 30, arrival_time=2.0)
    while engine.scheduler.num_preemptions == 0:
        engine.step()
    assert new.status is RequestStatus.PREEMPTED and new.block_ids == [] and new.state_slot is None
    assert engine.scheduler.waiting[0] is new
    assert old.status is RequestStatus.RUNNING
    drain(engine)
    assert new.num_preemptions >= 1 and len(new.output_token_ids) == 40


def test_priority_policy_runs_the_lowest_priority_value_first(make_engine):
    engine = make_engine(max_num_seqs=1, scheduling_policy="priority")
    short = SamplingParams(max_tokens=2, ignore_eos=True)
    add(engine, "low", 5, short, priority=2)
    add(engine, "high", 5, short, priority=0)
    add(engine, "mid", 5, short, priority=1)
    assert drain(engine) == ["high", "mid", "low"]


def test_fcfs_policy_runs_in_arrival_order_whatever_the_priority(make_engine):
    engine = make_engine(max_num_seqs=1)
    short = SamplingParams(max_tokens=2, ignore_eos=True)
    add(engine, "a", 5, short, priority=2)
    add(engine, "b", 5, short, priority=0)
    assert drain(engine) == ["a", "b"]
