"""The engine on gloo ranks: the logits every step hands the sampler equal the single-process engine's
(fp32, relative 1e-5) for the tiny presets under every layout, over a scenario of chunked prefill, decodes,
prompt logprobs, a one-token prompt (under DCP4 three of its four shards are empty; the other contexts
split unevenly) and a prefix-cache hit (its slot and tail-page copies applied on every rank), and the
greedy tokens are the same. Under DCP the scheduler's block is block_size tokens of each of the W ranks,
so the single-process engine runs with that block."""

from __future__ import annotations

import pytest
from dist_util import LogitsRecorder, parallel_engine, worst_step_error

from hyserve import LLM, SamplingParams

PRESETS = ["kimi-linear-tiny", "k3-tiny", "k3.1-tiny"]
# (id, world, fields)
LAYOUTS = [
    ("tp2", 2, {}),
    ("tp4", 4, {}),
    ("tp2-ep", 2, dict(enable_expert_parallel=True)),
    ("dcp2", 2, dict(decode_context_parallel_size=2)),
    ("dcp4", 4, dict(decode_context_parallel_size=4)),
]
PAGE = 4  # tokens per page of a rank
GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
# chunked prefill (8-token budget), a one-token prompt, and a request wanting prompt logprobs
FIRST = [list(range(3, 16)), list(range(40, 47)), [99]]
SCENARIO = dict(max_num_batched_tokens=8, prefix_cache_second_hit=False)


def _run(engine) -> tuple[list, list[list[int]], int]:
    """(logits of every step, greedy tokens, tokens the second round's prefix hit skipped)."""
    rec = LogitsRecorder(engine)
    llm = LLM.from_engine(engine)
    params = [GREEDY, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, prompt_logprobs=1), GREEDY]
    first = llm.generate([{"prompt_token_ids": p} for p in FIRST], params, use_tqdm=False)
    # shares the first prompt: resumes from its prompt-end checkpoint, a copied state slot and tail page
    again = llm.generate([{"prompt_token_ids": FIRST[0] + [7, 8]}], GREEDY, use_tqdm=False)[0]
    return rec.steps, [o.outputs[0].token_ids for o in [*first, again]], again.num_cached_tokens


_REFS: dict[tuple[str, int], tuple] = {}


def _reference(preset: str, block: int):
    if (preset, block) not in _REFS:
        _REFS[preset, block] = _run(parallel_engine(preset, block_size=block, **SCENARIO))
    return _REFS[preset, block]


@pytest.mark.parametrize("layout", LAYOUTS, ids=[name for name, _, _ in LAYOUTS])
@pytest.mark.parametrize("preset", PRESETS)
def test_engine_logits_equal_the_single_process_engine(preset, layout):
    _, world, fields = layout
    dcp = fields.get("decode_context_parallel_size", 1)
    engine = parallel_engine(preset, world, block_size=PAGE, **SCENARIO, **fields)
    try:
        got, tokens, hit = _run(engine)
    finally:
        engine.model.close()
    ref, ref_tokens, ref_hit = _reference(preset, PAGE * dcp)
    assert hit == ref_hit == len(FIRST[0]) - 1
    assert worst_step_error(got, ref) < 1e-5
    assert tokens == ref_tokens


def test_dcp_holds_w_times_the_context_of_tp_in_the_same_memory(caplog):
    with caplog.at_level("INFO", logger="hyserve.distributed.executor"):
        tp, dcp = (parallel_engine("k3-tiny", 2, block_size=PAGE, **fields)
                   for fields in ({}, dict(decode_context_parallel_size=2)))
        dcp.model.close()
        tp.model.close()
    assert dcp.kv.num_blocks == tp.kv.num_blocks and dcp.kv.block_size == 2 * tp.kv.block_size
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("KV cache of rank")]
    assert len(lines) == 4 and "KV cache of rank 1:" in lines[1]
    assert "(DCP2: 1/2 of them stored here)" in lines[3] and "this rank's heads" in lines[3]


def test_the_engine_process_cache_refuses_writes_that_would_not_reach_the_ranks():
    engine = parallel_engine("k3-tiny", 2, block_size=PAGE)
    try:
        t = engine.kv.tensors
        assert t.conv.shape[0] == engine.cache_plan.num_slots and t.pages.device.type == "meta"
        with pytest.raises(RuntimeError, match="the data lives on the ranks"):
            t.conv[1] = t.conv[0]
        t.copy_slots([0], [1])  # queued for every rank's next step
        assert t.take_ops() == [("copy_slots", [0], [1])] and t.take_ops() == []
    finally:
        engine.model.close()
