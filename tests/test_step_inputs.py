"""The one builder of a step's inputs (engine/step_inputs.py): the same positions, slot mapping, block
tables and sequence rows as `Batch.build` computes from the same lists, token ids with the pending ones
left to the device, padding rows that touch only the scratch page and slot, and a packed layout whose
rows start 16-byte aligned whatever the step's sizes."""

from __future__ import annotations

import pytest
import torch

from hyserve import SamplingParams
from hyserve.engine.request import Request
from hyserve.engine.scheduler import ScheduledSeq
from hyserve.engine.step_inputs import Padding, PendingTokens, StepLayout, build_step_inputs
from hyserve.models.batch import Batch

BS = 4


def seq(prompt: list[int], outputs: list[int], start: int, n: int, blocks: list[int], slot: int,
        pending: int = 0, fresh: bool = False) -> ScheduledSeq:
    req = Request(f"r{slot}", prompt, SamplingParams(), max_tokens=64, output_token_ids=list(outputs),
                  block_ids=blocks, state_slot=slot, num_pending=pending)
    return ScheduledSeq(req, n, start, fresh)


def mixed_step() -> tuple[list[ScheduledSeq], PendingTokens]:
    chunk = seq(list(range(10, 21)), [], 3, 6, [7, 2, 5], 0, fresh=True)  # a prefill chunk: positions 3..8
    decode = seq([1, 2, 3], [4, 5], 4, 1, [9, 4], 1)  # the host knows its last token (id 5 at position 4)
    waiting = seq([6, 7, 8, 9], [30], 5, 1, [3, 8], 2, pending=1)  # its last token is still on the device
    return [chunk, decode, waiting], PendingTokens(torch.tensor([0, 0, 77]), {waiting.req: 2})


def test_a_mixed_step_matches_batch_build_and_leaves_pending_ids_to_the_device():
    seqs, pending = mixed_step()
    inputs = build_step_inputs(seqs, BS, pending)
    v = inputs.layout.views(inputs.flat)
    ref = Batch.build([6, 1, 1], [9, 5, 6], [s.req.block_ids for s in seqs], BS, [0, 1, 2], [True, False, False])
    for name in ("positions", "slot_mapping", "block_tables", "cu_seqlens", "state_slots", "fresh_state"):
        assert torch.equal(getattr(v, name), getattr(ref, name)), name
    assert torch.equal(v.context_lens, ref.context_lens_device)
    assert v.input_ids.tolist() == [13, 14, 15, 16, 17, 18, 5, 0]  # 0: the pending token's placeholder
    # the ids of the gather pool [previous step's ids | ids row]: row 2 of the previous step for the last
    assert v.id_sources.tolist() == [3, 4, 5, 6, 7, 8, 9, 2] and inputs.pending
    pool = torch.cat([pending.token_ids, v.input_ids])
    assert pool[v.id_sources].tolist() == [13, 14, 15, 16, 17, 18, 5, 77]
    assert v.logits_indices.tolist() == [6, 7] and inputs.sample_rows == [1, 2]  # the chunk does not sample


def test_a_token_neither_known_nor_pending_is_an_error():
    seqs, _ = mixed_step()
    with pytest.raises(RuntimeError, match="not known"):
        build_step_inputs(seqs, BS)


def test_padding_rows_decode_token_zero_into_the_scratch_page_and_slot():
    seqs, pending = mixed_step()
    decodes = seqs[1:]
    inputs = build_step_inputs(decodes, BS, pending, pad=Padding(4, 11, 6), width=5, prev_len=8, sampled=False)
    v = inputs.layout.views(inputs.flat)
    assert v.positions.tolist()[2:] == [0, 0] and v.slot_mapping.tolist()[2:] == [11 * BS] * 2
    assert v.context_lens.tolist() == [5, 6, 1, 1] and v.state_slots.tolist() == [1, 2, 6, 6]
    assert v.fresh_state.tolist() == [False, False, True, True] and v.cu_seqlens.tolist() == [0, 1, 2, 3, 4]
    assert v.block_tables.tolist()[2:] == [[11, -1, -1, -1, -1]] * 2
    assert v.id_sources.tolist() == [8, 2, 10, 11]  # padding rows read their 0 from the ids row
    assert inputs.query_lens == [1, 1] and v.logits_indices.numel() == 0


@pytest.mark.parametrize("t, n, s, w", [(1, 1, 1, 1), (7, 3, 2, 5), (513, 9, 0, 3), (2, 2, 1, 128)])
def test_every_row_starts_16_byte_aligned(t, n, s, w):
    layout = StepLayout(t, n, s, w)
    assert all(o % 2 == 0 for o in layout.offsets)
    v = layout.views(torch.zeros(layout.words, dtype=torch.long))
    for name in ("input_ids", "positions", "slot_mapping", "id_sources", "context_lens", "state_slots",
                 "cu_seqlens", "logits_indices", "fresh_state", "block_tables"):
        assert getattr(v, name).data_ptr() % 16 == 0, name
