"""CUDA graphs for verify steps (engine/cuda_graphs.py): a step whose rows all verify k drafts replays the
graph of (batch size, 1 + k) over the static buffers. On the CPU there is nothing to capture, and the same
buffers, padding and static `DecodeRows` run the forward directly: these tests check everything but the
replay itself (tests/gpu/test_verify_graphs_gpu.py replays them)."""

from __future__ import annotations

import pytest
import torch
from test_cuda_graphs import _cache_copy, _changed_rows, _restore
from test_spec_engine import GREEDY, NGRAM, K, Oracle, repetitive_prompts, run

from hyserve import SamplingParams
from hyserve.engine.cuda_graphs import graph_batch_sizes, verify_graph_sizes
from hyserve.engine.request import Request
from hyserve.engine.scheduler import ScheduledSeq
from hyserve.engine.step_inputs import Padding, build_step_inputs
from hyserve.spec_decode.config import parse_speculative_config


def _verify_calls(llm) -> list[tuple[int, int, int]]:
    """(real rows, padded rows, tokens per row) of every step the static buffers run with more than one
    token per row."""
    graphs, calls = llm.engine.runner.graphs, []
    run_ = graphs.run

    def counted(inputs, prev=None):
        lay = inputs.layout
        if lay.num_tokens > lay.num_seqs:
            calls.append((len(inputs.query_lens), lay.num_seqs, lay.num_tokens // lay.num_seqs))
        return run_(inputs, prev)

    graphs.run = counted
    return calls


def test_each_draft_count_gets_a_ladder_up_to_the_batch_that_still_speculates():
    spec = parse_speculative_config({**NGRAM, "disable_by_batch_size": 6})
    assert verify_graph_sizes(spec, 8, 16) == {q: graph_batch_sizes(5) for q in range(2, K + 2)}
    wide = parse_speculative_config({**NGRAM, "num_speculative_tokens": 40})
    sizes = verify_graph_sizes(wide, 512, 16)
    assert max(sizes) == 16  # a padding row's tokens fit one scratch page
    assert all(s[-1] * q <= 256 and s[-1] <= 64 for q, s in sizes.items())
    assert verify_graph_sizes(None, 8, 16) == {}
    dspark = parse_speculative_config({"method": "dspark", "model": "x", "num_speculative_tokens": 3})
    assert verify_graph_sizes(dspark, 8, 16) == {q: graph_batch_sizes(8) for q in range(2, 5)}


def test_a_dsa_model_has_no_verify_graphs(make_engine):
    eng = make_engine("k3.1-tiny", static_decode_buffers=True, speculative_config=NGRAM)
    assert eng.runner.graphs.verify_sizes == {}
    plain = make_engine("k3-tiny", static_decode_buffers=True, speculative_config=NGRAM)
    assert sorted(plain.runner.graphs.verify_sizes) == list(range(2, K + 2))


def test_a_padded_verify_step_puts_its_padding_rows_in_the_scratch_page_and_slot():
    pad = Padding(rows=3, scratch_block=9, scratch_slot=5, tokens=3, spec_width=4)
    inputs = build_step_inputs([], 4, pad=pad, width=2, prev_len=0, sampled=False)
    v = inputs.layout.views(inputs.flat)
    assert v.positions.tolist() == [0, 1, 2] * 3
    assert v.slot_mapping.tolist() == [36, 37, 38] * 3
    assert v.cu_seqlens.tolist() == [0, 3, 6, 9] and v.context_lens.tolist() == [3, 3, 3]
    assert v.spec_slots.tolist() == [[5] * 4] * 3 and v.spec_src.tolist() == [0, 0, 0]
    assert v.state_slots.tolist() == [5, 5, 5] and v.fresh_state.tolist() == [True] * 3
    assert v.block_tables.tolist() == [[9, -1]] * 3
    with pytest.raises(ValueError, match="scratch page"):
        build_step_inputs([], 2, pad=pad, width=2, prev_len=0, sampled=False)


def _spec_seq(prompt, outputs, start, blocks, slots, state, drafts=()) -> ScheduledSeq:
    req = Request(f"r{state}", prompt, SamplingParams(), max_tokens=64, output_token_ids=list(outputs),
                  block_ids=blocks, state_slot=state, spec_slots=slots)
    return ScheduledSeq(req, 1 + len(drafts), start, False, tuple(drafts))


def test_a_step_of_mixed_draft_counts_pads_the_shorter_rows_into_the_scratch_page_and_slot():
    decode = _spec_seq([1, 2, 3, 4, 5], [6, 7, 8], 7, [9, 4], None, 1)  # positions 7 (+ 8..10 padding)
    short = _spec_seq([6, 7, 8, 9], [30], 4, [3, 8], [10, 11, 12, 13], 12, [31])  # 4, 5 (+ 6, 7)
    full = _spec_seq([1] * 7, [2], 7, [6, 0, 1], [20, 21, 22, 23], 20, [3, 4, 5])  # 7..10
    pad = Padding(rows=4, scratch_block=15, scratch_slot=99, tokens=4, spec_width=4)
    inputs = build_step_inputs([decode, short, full], 4, pad=pad, width=3, prev_len=0, sampled=False)
    v = inputs.layout.views(inputs.flat)
    assert v.positions.tolist() == [7, 8, 9, 10, 4, 5, 6, 7, 7, 8, 9, 10, 0, 1, 2, 3]
    assert v.input_ids.tolist()[:12] == [8, 0, 0, 0, 30, 31, 0, 0, 2, 3, 4, 5]
    # real tokens write their own pages; padding tokens only the scratch page (15 * 4 + their offset)
    assert v.slot_mapping.tolist() == [19, 61, 62, 63, 32, 33, 62, 63, 3, 4, 5, 6, 60, 61, 62, 63]
    assert v.block_tables.tolist()[:3] == [[9, 4, 15], [3, 8, -1], [6, 0, 1]]  # reads past a table: scratch
    assert v.context_lens.tolist() == [11, 8, 11, 4]
    # a decode updates its state in place through column 0; the padding's states go to the scratch slot
    assert v.spec_slots.tolist() == [[1, 99, 99, 99], [10, 11, 12, 13], [20, 21, 22, 23], [99] * 4]
    assert v.spec_src.tolist() == [0, 2, 0, 0] and v.state_slots.tolist() == [1, 12, 20, 99]
    assert inputs.query_lens == [1, 2, 4] and inputs.context_lens == [8, 6, 11]
    assert inputs.real_tokens == inputs.sample_tokens == [0, 4, 5, 8, 9, 10, 11]


class Ragged(Oracle):
    """The oracle's drafts cut to a count that differs from request to request and step to step (none
    among them), so verify steps mix draft counts and decodes."""

    def propose(self, histories, keys=None):
        out = super().propose(histories, keys)
        return [d[: (self.calls + i) % (K + 1)] for i, d in enumerate(out)]


@pytest.mark.parametrize("model", ["k3-tiny", "kimi-linear-tiny"])
def test_verify_steps_of_mixed_draft_counts_run_through_the_static_buffers_and_keep_the_output(make_llm, model):
    prompts = repetitive_prompts(3, seed=6)
    plain = run(make_llm(model, max_num_seqs=4), prompts)
    llm = make_llm(model, static_decode_buffers=True, max_num_seqs=4, speculative_config=NGRAM)
    llm.engine.spec.proposer = Ragged({tuple(p): o for p, o in zip(prompts, plain)})
    graphs, ragged = llm.engine.runner.graphs, []
    run_ = graphs.run

    def counted(inputs, prev=None):
        ragged.append(inputs.real_tokens is not None)
        return run_(inputs, prev)

    graphs.run = counted
    assert run(llm, prompts) == plain
    assert sum(ragged) >= 3
    st = llm.engine.stats.spec_decode
    assert 0 < st.num_accepted_tokens < st.num_draft_tokens


@pytest.mark.parametrize("model", ["k3-tiny", "kimi-linear-tiny"])
def test_verify_steps_of_one_draft_count_run_through_the_static_buffers_and_keep_the_output(make_llm, model):
    """Oracle drafts: K drafts a step (fewer near the end), accepted and rejected; three prompts, so steps of
    three rows padded to the ladder's 4."""
    prompts = repetitive_prompts(3, seed=5)
    plain = run(make_llm(model, max_num_seqs=4), prompts)
    llm = make_llm(model, static_decode_buffers=True, max_num_seqs=4, speculative_config=NGRAM)
    llm.engine.spec.proposer = Oracle({tuple(p): o for p, o in zip(prompts, plain)})
    calls = _verify_calls(llm)
    assert run(llm, prompts) == plain
    assert {q for *_, q in calls} >= {1 + K} and any(n < size for n, size, _ in calls)
    st = llm.engine.stats.spec_decode
    assert 0 < st.num_accepted_tokens < st.num_draft_tokens


def test_a_verify_step_through_the_static_buffers_equals_the_eager_step(make_engine):
    """The same verify step of three rows (padded to 4) from the same cache: logits and every real row's
    pages and state columns as the eager step computes them; past them only the scratch page and slot."""
    eng = make_engine("kimi-linear-tiny", static_decode_buffers=True, dtype="float32", speculative_config=NGRAM,
                      max_num_seqs=4)
    prompts = repetitive_prompts(3, seed=8)
    refs = {tuple(p): [p[-1]] * GREEDY.max_tokens for p in prompts}
    eng.spec.proposer = Oracle(refs)
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, GREEDY)
    runner, seen = eng.runner, []
    execute = runner.execute

    def compare(out, pending=None):
        if len(out.seqs) != 3 or not runner.uses_graph(out) or seen:
            return execute(out, pending)
        kv = eng.kv
        kv.tensors.pages[kv.scratch_block] = 0
        kv.tensors.conv[kv.scratch_slot] = 0
        kv.tensors.recurrent[kv.scratch_slot] = 0
        before = _cache_copy(eng)
        graphs, runner.graphs = runner.graphs, None
        eager = execute(out).logits.clone()
        want = _cache_copy(eng)
        runner.graphs = graphs
        _restore(eng, before)
        got = execute(out)
        after = _cache_copy(eng)
        seen.append(out)
        torch.testing.assert_close(got.logits, eager, rtol=1e-4, atol=1e-5)
        slots = {c for s in out.seqs for c in s.req.spec_slots}
        pages = {b for s in out.seqs for b in s.req.block_ids}
        for name, rows in (("pages", pages), ("conv", slots), ("recurrent", slots)):
            idx = torch.tensor(sorted(rows))
            torch.testing.assert_close(after[name][idx], want[name][idx], rtol=1e-4, atol=1e-5)
        assert _changed_rows(after["pages"], want["pages"]) <= {kv.scratch_block}
        assert _changed_rows(after["recurrent"], want["recurrent"]) <= {kv.scratch_slot}
        return got

    runner.execute = compare
    while eng.has_unfinished_requests():
        eng.step()
    assert seen, "no verify step of three rows ran"


def _recorded_blocks(llm) -> list[tuple[int, list[int]]]:
    """(context length, drafts) of every block the dspark proposer drafts."""
    proposer, seen = llm.engine.spec.proposer, []
    original = proposer.propose

    def recording(req_ids, anchors, temps=None, gens=None):
        block = original(req_ids, anchors, temps, gens)
        seen.extend((proposer.num_context(r), block.token_ids[i].tolist()) for i, r in enumerate(req_ids))
        return block

    proposer.propose = recording
    return seen


def test_dspark_runs_its_steps_through_the_static_buffers_with_the_features_of_the_eager_steps(make_llm, drafter_dir):
    """dspark with graphs: decode and verify steps run through the static buffers, whose feature buffer
    hands the drafter the same target features as the eager forward's taps, so every block drafted is the
    eager engine's and the greedy output is plain decoding's."""
    prompts = repetitive_prompts(3, seed=5)
    kw = dict(max_num_seqs=4, enable_prefix_caching=False)
    plain = run(make_llm(**kw), prompts)
    spec = {"method": "dspark", "model": drafter_dir}
    eager = make_llm(speculative_config=spec, **kw)
    eager_blocks = _recorded_blocks(eager)
    assert run(eager, prompts) == plain
    llm = make_llm(static_decode_buffers=True, speculative_config=spec, **kw)
    assert llm.engine.runner.graphs.features.shape[1] == 2 * llm.engine.model_config.hidden_size
    calls, blocks = _verify_calls(llm), _recorded_blocks(llm)
    assert run(llm, prompts) == plain
    assert calls and any(n < size for n, size, _ in calls)  # verify steps, padded ones among them
    assert blocks == eager_blocks
