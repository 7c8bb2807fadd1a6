"""The MLA layer's GPU path (`MLAttention._attend_fast`) on a step with speculative verify rows, run by
Triton's CPU interpreter against the layer's reference path: every token of a verify row is a one-token
query of the decode kernel over the positions up to its own (`Batch.decode_rows`), beside plain decodes
and a prefill chunk; the expanded prefill path is left to prompt chunks."""

from __future__ import annotations

import pytest
import torch
from interpret_util import INTERPRETED
from mla_step_util import STEP, STEP_WITH_PREFILL, layer_of, run, step_of

pytestmark = INTERPRETED


@pytest.mark.parametrize("preset", ["kimi-linear-tiny", "k3-tiny"])
def test_verify_rows_take_the_decode_kernel_and_match_the_reference(preset, monkeypatch):
    layer = layer_of(preset, 0)
    x, batch, cache = step_of(layer, STEP, 1)
    ref, ref_pages, out, pages, calls = run(layer, x, batch, cache, monkeypatch)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(pages, ref_pages, rtol=1e-5, atol=1e-6)
    assert calls == {"decode": [sum(q for _, q, _ in STEP)], "prefill": []}, "one decode call over every row"


def test_a_prefill_chunk_beside_verify_rows_still_takes_the_prefill_path(monkeypatch):
    layer = layer_of("k3-tiny", 2)
    x, batch, cache = step_of(layer, STEP_WITH_PREFILL, 3)
    ref, ref_pages, out, pages, calls = run(layer, x, batch, cache, monkeypatch)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(pages, ref_pages, rtol=1e-5, atol=1e-6)
    assert calls == {"decode": [sum(q for _, q, _ in STEP)], "prefill": [5]}


def test_decode_rows_give_each_verify_token_the_context_up_to_its_own_position():
    layer = layer_of("kimi-linear-tiny", 0)
    _, batch, _ = step_of(layer, STEP_WITH_PREFILL, 1)
    rows = batch.decode_rows
    # tokens: verify 0-2, decode 3, (prefill 4-8), verify 9-12, decode 13
    assert rows.tokens.tolist() == [0, 1, 2, 3, 9, 10, 11, 12, 13]
    assert rows.seqs.tolist() == [0, 0, 0, 1, 3, 3, 3, 3, 4]
    assert rows.context_lens.tolist() == [12, 13, 14, 9, 3, 4, 5, 6, 1]
    assert rows.max_context == 14 and not rows.whole_step
