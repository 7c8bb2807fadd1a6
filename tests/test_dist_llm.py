"""`LLM(..., tensor_parallel_size=...)` on gloo processes: greedy generation equals one process, with the
prefix cache hitting and prefill chunked; the static decode buffers (the CUDA-graph path) and async
scheduling (ids still on the sampler's device) under TP2 and DCP2; and a rank that fails (killed, or
raising in its forward) ends the engine with a clear error within seconds, not a hang."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from dist_util import all_exit, parallel_engine

from hyserve import LLM, SamplingParams
from hyserve.distributed import ParallelConfigError
from hyserve.distributed import worker as rank_worker
from hyserve.engine.engine_core import EngineDeadError

SMALL = dict(device="cpu", kv_cache_memory_bytes=4 << 20, max_num_seqs=8, block_size=8)
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
PROMPTS = ["The quick brown fox jumps over the lazy dog", "hi", "Tensor parallel ranks agree on"]


@pytest.fixture(scope="module")
def one_process():
    return LLM("k3-tiny", max_num_batched_tokens=16, **SMALL)


@pytest.fixture(scope="module")
def tp2():
    """An LLM whose engine starts its own two rank processes (as users get it)."""
    llm = LLM("k3-tiny", tensor_parallel_size=2, max_num_batched_tokens=16, **SMALL)
    yield llm
    llm.engine.model.close()


def _ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_greedy_generation_equals_one_process_with_chunked_prefill(tp2, one_process):
    got, want = tp2.generate(PROMPTS, GREEDY, use_tqdm=False), one_process.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert _ids(got) == _ids(want) and [o.outputs[0].text for o in got] == [o.outputs[0].text for o in want]


def test_a_request_sharing_a_prefix_hits_and_gives_the_same_output(tp2, one_process):
    first = PROMPTS[0] + " and runs"
    tp2.generate([first], GREEDY, use_tqdm=False)
    again = tp2.generate([first + " away from it"], GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens > 0
    assert _ids([again]) == _ids(one_process.generate([first + " away from it"], GREEDY, use_tqdm=False))


def test_a_layout_the_model_cannot_split_is_a_value_error_before_any_process():
    with pytest.raises(ParallelConfigError, match="is not divisible by 8"):
        LLM("k3-tiny", tensor_parallel_size=8, device="cpu")


def test_generate_prints_a_layout_the_model_cannot_split_and_exits_non_zero(capsys):
    import argparse

    from hyserve.entrypoints.generate import add_generate_parser, run_generate

    parser = argparse.ArgumentParser()
    add_generate_parser(parser.add_subparsers())
    args = parser.parse_args(["generate", "k3-tiny", "--prompt", "hi", "--device", "cpu", "-tp", "3"])
    assert run_generate(args) == 2
    assert "KDA num_heads = 4 is not divisible by 3" in capsys.readouterr().err


# ---- the static decode buffers and async scheduling, on the shared pools ------------------------------------

LAYOUTS = [("tp2", dict()), ("tp2-ep", dict(enable_expert_parallel=True)), ("dcp2", dict(decode_context_parallel_size=2))]
MODES = [("static", dict(static_decode_buffers=True)), ("async", dict(async_scheduling=True)),
         ("static-async", dict(static_decode_buffers=True, async_scheduling=True))]
TOKEN_PROMPTS = [list(range(5, 19)), [3, 4], list(range(60, 69))]


def _greedy(engine) -> tuple[list[list[int]], int]:
    """(greedy tokens, steps that went through the static buffers)."""
    graph_steps, execute = [], engine.runner.execute

    def counted(out, pending=None):
        graph_steps.append(engine.runner.uses_graph(out))
        return execute(out, pending)

    engine.runner.execute = counted
    outs = LLM.from_engine(engine).generate([{"prompt_token_ids": p} for p in TOKEN_PROMPTS], GREEDY, use_tqdm=False)
    return _ids(outs), sum(graph_steps)


@pytest.mark.parametrize("mode", MODES, ids=[m for m, _ in MODES])
@pytest.mark.parametrize("layout", LAYOUTS, ids=[name for name, _ in LAYOUTS])
def test_decode_paths_under_a_layout_equal_one_eager_process(layout, mode):
    fields = dict(block_size=4, max_num_batched_tokens=8)
    dcp = layout[1].get("decode_context_parallel_size", 1)
    want, _ = _greedy(parallel_engine("k3.1-tiny", **{**fields, "block_size": 4 * dcp}))
    engine = parallel_engine("k3.1-tiny", 2, **fields, **layout[1], **mode[1])
    try:
        got, graph_steps = _greedy(engine)
    finally:
        engine.model.close()
    assert got == want
    assert (graph_steps > 0) == ("static" in mode[0])


# ---- failures ------------------------------------------------------------------------------------------------

def _raise_in_rank_1_forward(state, key) -> None:
    if state.rank == 1:
        def fail(*args, **kwargs):
            raise RuntimeError("rank 1 hit a fault in its forward")

        rank_worker._ENGINES[key].model.forward = fail


def test_an_exception_in_a_ranks_forward_ends_the_engine_with_its_error():
    llm = LLM("k3-tiny", tensor_parallel_size=2, **SMALL)
    pids = llm.engine.model.pool.pids
    llm.engine.model.run(_raise_in_rank_1_forward)
    t0 = time.monotonic()
    with pytest.raises(EngineDeadError, match="rank 1 hit a fault in its forward"):
        llm.generate(["hello"], GREEDY, use_tqdm=False)
    assert time.monotonic() - t0 < 30  # rank 0 waits in a collective with rank 1: it is stopped, not waited for
    assert all_exit(pids)
    with pytest.raises(EngineDeadError, match="failed earlier"):
        llm.generate(["hello"], GREEDY, use_tqdm=False)


def test_a_killed_rank_ends_the_engine_mid_generation():
    llm = LLM("k3-tiny", tensor_parallel_size=2, **SMALL)
    pids = llm.engine.model.pool.pids
    threading.Timer(1.0, os.kill, (pids[1], signal.SIGKILL)).start()
    t0 = time.monotonic()
    with pytest.raises(EngineDeadError, match=r"rank 1: the process exited with code -9"):
        llm.generate(["hello"], SamplingParams(max_tokens=100_000, temperature=0, ignore_eos=True), use_tqdm=False)
    assert time.monotonic() - t0 < 30
    assert all_exit(pids)
