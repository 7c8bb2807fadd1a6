"""The rank pool and its process groups on gloo: results come back per rank, and a rank that fails makes
the call fail with an error naming it, within the group timeout, instead of hanging."""

from __future__ import annotations

import os
import time

import pytest
import torch
from dist_util import all_exit, rank_pool

from hyserve import envs
from hyserve.distributed import ParallelConfig
from hyserve.distributed.comm import CollectiveError
from hyserve.distributed.groups import single_process_state
from hyserve.distributed.launch import RankFailedError, RankPool

TIMEOUT_S = 2.0


def _sum_of_ranks(state) -> float:
    return float(state.tp.all_reduce(torch.tensor([float(state.rank)])).item())


def _groups(state) -> tuple[int, int, int, list[int]]:
    return state.tp.size, state.ep.size, state.dcp.rank, state.dcp.ranks


def _rank1_raises(state) -> float:
    if state.rank == 1:
        raise ValueError("weights of rank 1 are corrupt")
    return _sum_of_ranks(state)


def _rank1_dies(state) -> float:
    if state.rank == 1:
        os._exit(7)
    return _sum_of_ranks(state)


def _collective_error_text(state) -> str:
    if state.rank == 1:
        time.sleep(TIMEOUT_S + 1)  # alive but never joins
        return ""
    try:
        _sum_of_ranks(state)
    except CollectiveError as e:
        return str(e)
    return "no error"


def test_run_returns_each_ranks_result():
    assert rank_pool(2).run(_sum_of_ranks) == [1.0, 1.0]


def test_groups_follow_the_layout():
    cfg = ParallelConfig(tensor_parallel_size=4, enable_expert_parallel=True, decode_context_parallel_size=2)
    got = rank_pool(4).run(_groups, layout=cfg)
    assert got == [(4, 4, 0, [0, 1]), (4, 4, 1, [0, 1]), (4, 4, 0, [2, 3]), (4, 4, 1, [2, 3])]


def test_a_rank_that_raises_fails_the_call_within_the_timeout():
    pool = RankPool(ParallelConfig(tensor_parallel_size=2), timeout_s=TIMEOUT_S, threads=1)
    t0 = time.monotonic()
    with pytest.raises(RankFailedError) as err:
        pool.run(_rank1_raises)
    assert time.monotonic() - t0 < 2 * TIMEOUT_S + 10
    assert "rank 1" in str(err.value) and "weights of rank 1 are corrupt" in str(err.value)
    assert "rank 0" in str(err.value) and "CollectiveError" in str(err.value)  # the peer timed out, not hung
    with pytest.raises(RankFailedError, match="failed earlier"):
        pool.run(_sum_of_ranks)


def test_a_rank_that_dies_fails_the_call():
    pool = RankPool(ParallelConfig(tensor_parallel_size=2), timeout_s=TIMEOUT_S, threads=1)
    t0 = time.monotonic()
    with pytest.raises(RankFailedError, match="exited with code 7"):
        pool.run(_rank1_dies)
    assert time.monotonic() - t0 < 2 * TIMEOUT_S + 10


def test_a_collective_error_names_the_group_and_the_timeout():
    pool = RankPool(ParallelConfig(tensor_parallel_size=2), timeout_s=TIMEOUT_S, threads=1)
    try:
        text = pool.run(_collective_error_text)[0]
    finally:
        pool.close()
    assert "all_reduce over the tp group (ranks [0, 1]) failed on its rank 0" in text
    assert f"within {TIMEOUT_S:g} s" in text


def _agree(state) -> tuple[int, int]:
    from hyserve.distributed.capacity import agree_on_counts

    return agree_on_counts(state.tp, 100 - state.rank, 10 + state.rank)


def test_ranks_agree_on_the_smallest_cache():
    assert rank_pool(2).run(_agree) == [(99, 10), (99, 10)]


def test_capacity_under_dcp_counts_w_times_the_context():
    from hyserve.distributed.capacity import RankCapacity

    tp = RankCapacity(0, 1000, 64, 1, 8, 1 << 20, 1 << 20)
    dcp = RankCapacity(0, 1000, 64, 4, 8, 1 << 20, 1 << 20)
    assert dcp.context_tokens == 4 * tp.context_tokens == 256000 and dcp.scheduler_block_size == 256
    assert "rank 0: 1000 pages x 64 tokens = 0.977 GiB for 256000 context tokens (DCP4" in dcp.describe()


def test_the_group_timeout_is_read_from_hyserve_dist_timeout_s():
    assert envs.read({}).dist_timeout_s == 600.0
    assert envs.read({"HYSERVE_DIST_TIMEOUT_S": "42.5"}).dist_timeout_s == 42.5
    assert single_process_state().tp.timeout_s == envs.get().dist_timeout_s


@pytest.mark.parametrize("value", ["0", "-1", "ten", "inf"])
def test_a_bad_hyserve_dist_timeout_s_is_an_error_naming_it(value):
    with pytest.raises(ValueError, match="HYSERVE_DIST_TIMEOUT_S"):
        envs.read({"HYSERVE_DIST_TIMEOUT_S": value})


_ORPHAN = """
import sys, time
from hyserve.distributed import ParallelConfig
from hyserve.distributed.launch import RankPool
if __name__ == "__main__":
    pool = RankPool(ParallelConfig(tensor_parallel_size=2), threads=1)
    print(*pool.pids, flush=True)
    time.sleep(600)
"""


def test_workers_leave_when_their_parent_is_killed(tmp_path):
    import signal
    import subprocess
    import sys

    script = tmp_path / "orphan.py"
    script.write_text(_ORPHAN)
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env)
    pids = [int(p) for p in parent.stdout.readline().split()]
    assert len(pids) == 2
    parent.send_signal(signal.SIGKILL)  # no atexit, no close: the workers must notice on their own
    parent.wait()
    assert all_exit(pids), "rank workers outlived their killed parent"
