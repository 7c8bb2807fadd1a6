"""CUDA graphs for verify steps on a GPU (engine/cuda_graphs.py): a speculating engine captures a ladder per
draft count at start, verify steps replay them (rows of fewer drafts, and decodes, padded to the graph's
length), and greedy output equals the eager engine's plain decoding. tests/test_verify_graphs.py checks the
static buffers on the CPU."""

from __future__ import annotations

import pytest
import torch
from test_spec_engine import NGRAM, K, Oracle, repetitive_prompts, run
from test_verify_graphs import Ragged, _recorded_blocks

from hyserve import LLM

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
KW = dict(device="cuda", dtype="float32", max_num_seqs=4, block_size=16, kv_cache_memory_bytes=64 << 20)


@pytest.mark.parametrize("name", ["kimi-linear-tiny", "k3-tiny"])
def test_verify_graphs_are_captured_replayed_and_keep_the_greedy_output(name):
    prompts = repetitive_prompts(3, seed=5) + [list(range(40, 90))]
    plain = run(LLM(name, enforce_eager=True, **KW), prompts)
    llm = LLM(name, speculative_config=NGRAM, **KW)
    graphs = llm.engine.runner.graphs
    want = {(s, q) for q, sizes in graphs.verify_sizes.items() for s in sizes}
    assert want and {k for k in graphs.graphs if k[1] > 1} == want  # float32 tiny models: every size captures
    llm.engine.spec.proposer = Oracle({tuple(p): o for p, o in zip(prompts, plain)})
    replays, run_ = [], graphs.run

    def counted(inputs, prev=None):
        lay = inputs.layout
        key = lay.num_seqs, lay.num_tokens // lay.num_seqs
        if key[1] > 1 and key in graphs.graphs:
            replays.append(key)
        return run_(inputs, prev)

    graphs.run = counted
    assert run(llm, prompts) == plain
    assert {q for _, q in replays} >= {1 + K}  # the oracle's full blocks of K drafts replayed
    st = llm.engine.stats.spec_decode
    assert 0 < st.num_accepted_tokens < st.num_draft_tokens


@pytest.mark.parametrize("name", ["kimi-linear-tiny", "k3-tiny"])
def test_verify_graphs_replay_steps_of_mixed_draft_counts_and_keep_the_greedy_output(name):
    """Drafts of different counts in one step, decodes among them: the shorter rows are padded to the
    graph's length and replayed (their padding writes only the scratch page and slot)."""
    prompts = repetitive_prompts(3, seed=6) + [list(range(40, 90))]
    plain = run(LLM(name, enforce_eager=True, **KW), prompts)
    llm = LLM(name, speculative_config=NGRAM, **KW)
    graphs = llm.engine.runner.graphs
    llm.engine.spec.proposer = Ragged({tuple(p): o for p, o in zip(prompts, plain)})
    ragged, run_ = [], graphs.run

    def counted(inputs, prev=None):
        lay = inputs.layout
        key = lay.num_seqs, lay.num_tokens // lay.num_seqs
        ragged.append(inputs.real_tokens is not None and key in graphs.graphs)
        return run_(inputs, prev)

    graphs.run = counted
    assert run(llm, prompts) == plain
    assert sum(ragged) >= 3


def test_dspark_replays_its_verify_graphs_and_drafts_from_the_replayed_features(drafter_dir):
    """The replay copies the tapped target features into the static buffer (hooks run only at capture): the
    drafter gets the eager engine's features, so it drafts the same blocks, and the output is plain decoding's."""
    prompts = repetitive_prompts(3, seed=5)
    kw = {**KW, "enable_prefix_caching": False}
    spec = {"method": "dspark", "model": drafter_dir, "confidence_threshold": 0}  # every block verified
    plain = run(LLM("k3-tiny", enforce_eager=True, **kw), prompts)
    outs, blocks = [], []
    for eager in (True, False):
        llm = LLM("k3-tiny", enforce_eager=eager, speculative_config=spec, **kw)
        blocks.append(_recorded_blocks(llm))
        outs.append(run(llm, prompts))
    graphs = llm.engine.runner.graphs
    assert {k for k in graphs.graphs if k[1] > 1}  # verify graphs captured
    assert outs == [plain, plain] and blocks[0] == blocks[1] and blocks[0]
