"""A KDA layer step with speculative verify rows on the GPU fast path (`kda_fast.kda_forward_fast`: the
Triton verify kernel, one call per row length, beside the decode kernel), run by Triton's CPU interpreter
against the layer's reference path (`KimiDeltaAttention._verify`, ops/kda_verify.py): the layer's output
and every state slot and conv window of the pools. tests/gpu/test_kda_fast_verify_gpu.py does the same on
CUDA at the 48B head shape."""

from __future__ import annotations

import pytest
import torch
from interpret_util import INTERPRETED
from kda_step_util import FAST, STEP, kda_layer, rel_err, run_both, verify_step

pytestmark = INTERPRETED


@pytest.mark.parametrize("preset", ["kimi-linear-tiny", "k3-tiny"])  # low-rank gate; full-rank gate, bounded decay
def test_a_step_with_verify_rows_of_two_lengths_and_decodes_equals_the_reference(preset, monkeypatch):
    layer = kda_layer(preset, torch.float32, "cpu", seed=1)
    x, batch, cache = verify_step(layer, torch.float32, "cpu", seed=2)
    ref, ref_cache, out, fast_cache, calls = run_both(layer, x, batch, cache, monkeypatch)
    # one decode call for both plain decodes, one verify call per row length (3 tokens: two sequences)
    assert calls == {"decode": 1, ("verify", 2): 1, ("verify", 3): 1}
    assert rel_err(out, ref) < 1e-5
    assert rel_err(fast_cache.recurrent, ref_cache.recurrent) < 1e-5
    assert rel_err(fast_cache.conv, ref_cache.conv) < 1e-6  # copies of the inputs


def test_a_step_of_verify_rows_of_one_length_runs_one_call_on_the_step_tensors_and_equals_the_reference(
        monkeypatch):
    """The verify graphs' case: every row verifies 1 + k tokens, each from a column that is also one of
    its tokens' destinations (the conv windows must be read before they are overwritten)."""
    layer = kda_layer("k3-tiny", torch.float32, "cpu", seed=9)
    step = [("verify", 3, 1, False), ("verify", 3, 2, False), ("verify", 3, 0, False)]
    x, batch, cache = verify_step(layer, torch.float32, "cpu", seed=10, step=step)
    assert [g.whole_step for g in batch.verify_groups] == [True]
    ref, ref_cache, out, fast_cache, calls = run_both(layer, x, batch, cache, monkeypatch)
    assert calls == {("verify", 3): 1}
    assert rel_err(out, ref) < 1e-5
    assert rel_err(fast_cache.recurrent, ref_cache.recurrent) < 1e-5
    assert torch.equal(fast_cache.conv, ref_cache.conv)  # copies of the inputs


def test_bf16_projections_and_conv_pool(monkeypatch):
    """The model dtype as served: the conv leaves in bf16 on both paths, the states stay fp32."""
    layer = kda_layer("kimi-linear-tiny", torch.bfloat16, "cpu", seed=3)
    x, batch, cache = verify_step(layer, torch.bfloat16, "cpu", seed=4)
    ref, ref_cache, out, fast_cache, calls = run_both(layer, x, batch, cache, monkeypatch)
    assert sum(calls.values()) == 3
    assert rel_err(out, ref) < 2e-2  # bf16 output rows (the reference rounds its own)
    assert rel_err(fast_cache.recurrent, ref_cache.recurrent) < 5e-3
    assert rel_err(fast_cache.conv, ref_cache.conv) < 1e-2  # the merged q|k|v GEMM may round apart


def test_the_verify_groups_are_built_from_host_lengths():
    """One group per row length, sequence-major token rows, the slot rows of its sequences in step order."""
    layer = kda_layer("kimi-linear-tiny", torch.float32, "cpu", seed=5)
    _, batch, _ = verify_step(layer, torch.float32, "cpu", seed=6)
    cu = batch.cu_seqlens_host
    groups = {g.tokens: g for g in batch.verify_groups}
    assert sorted(groups) == [2, 3] and batch.prefill_seqs == []
    assert not any(g.whole_step for g in groups.values())  # decodes between them
    by_len = {t: [i for i, (kind, q, _, _) in enumerate(STEP) if kind == "verify" and q == t] for t in (2, 3)}
    for t, g in groups.items():
        seqs = by_len[t]
        assert g.rows.tolist() == [r for i in seqs for r in range(cu[i], cu[i] + t)]
        members = [batch.verify.seqs.index(i) for i in seqs]
        assert torch.equal(g.slot_table, batch.verify.slot_table[members])
        assert torch.equal(g.src, batch.verify.src[members])


def test_the_fast_verify_path_never_reads_the_step_tensors_back():
    """Group lengths and token rows come from the host's query lengths, not from the device tensors."""
    from test_step_host_syncs import NoReadback

    from hyserve.models.layers.kda_fast import kda_forward_fast

    layer = kda_layer("kimi-linear-tiny", torch.float32, "cpu", seed=7)
    x, batch, cache = verify_step(layer, torch.float32, "cpu", seed=8)
    batch.cu_seqlens = batch.cu_seqlens.as_subclass(NoReadback)
    batch.verify.slot_table = batch.verify.slot_table.as_subclass(NoReadback)
    batch.verify.src = batch.verify.src.as_subclass(NoReadback)
    with torch.inference_mode():
        kda_forward_fast(layer, x, batch, cache, FAST)
