"""`Batch.prefill_rows`: what every KDA and MLA layer of a step needs to index its prefill chunks, built once
per step (hyserve/models/batch.py)."""

from __future__ import annotations

import torch

from hyserve.models.batch import Batch
from hyserve.ops.mla_attention import gather_rows

BS = 4


def _batch(query_lens: list[int], context_lens: list[int]) -> Batch:
    tables = [list(range(10 * i + 9, 10 * i, -1))[: -(-c // BS)] for i, c in enumerate(context_lens)]
    slots = [7, 3, 5, 1][: len(query_lens)]
    fresh = [False, True, False, True][: len(query_lens)]
    return Batch.build(query_lens, context_lens, tables, BS, slots, fresh)


def test_chunks_after_the_decodes_are_one_slice_of_the_step_rows():
    pre = _batch([1, 1, 6, 3], [9, 5, 6, 11]).prefill_rows
    assert pre.seqs == [2, 3] and pre.tokens == slice(2, 11) and not pre.whole_step
    assert pre.cu_host.tolist() == [0, 6, 9] and pre.cu.tolist() == [0, 6, 9]


def test_chunks_between_decodes_are_gathered_by_an_index():
    pre = _batch([6, 1, 3, 1], [6, 5, 11, 9]).prefill_rows
    assert pre.seqs == [0, 2]
    assert pre.tokens.tolist() == [0, 1, 2, 3, 4, 5, 7, 8, 9]


def test_a_step_of_chunks_only_takes_every_row_without_an_index():
    pre = _batch([6, 3], [6, 11]).prefill_rows
    assert pre.whole_step and pre.tokens == slice(None)


def test_the_chunks_carry_their_own_state_slots_and_fresh_flags():
    pre = _batch([1, 6, 1, 3], [9, 6, 5, 11]).prefill_rows
    assert pre.slots.tolist() == [3, 1] and pre.fresh.tolist() == [True, True]


def test_each_chunk_token_maps_to_its_chunk():
    pre = _batch([1, 4, 2], [3, 4, 7]).prefill_rows
    assert pre.seq_of_token.tolist() == [0, 0, 0, 0, 1, 1] and pre.seq_of_token.dtype == torch.int32


def test_a_decode_only_step_has_no_prefill_rows():
    assert _batch([1, 1], [5, 9]).prefill_rows is None


def test_the_context_rows_are_each_sequences_cached_positions_in_order():
    batch = _batch([1, 6, 3], [9, 6, 11])
    pages = torch.randn(40, 2, BS, 5)
    page, row = batch.prefill_rows.context_rows(batch.block_tables, BS)
    want = torch.cat([gather_rows(pages, 1, batch.block_tables[i], batch.context_lens[i]) for i in (1, 2)])
    assert torch.equal(pages[page, 1, row], want)


def test_every_layer_of_a_step_gets_the_same_tensors():
    batch = _batch([1, 6, 3], [9, 6, 11])
    first = batch.prefill_rows.context_rows(batch.block_tables, BS)
    assert batch.prefill_rows.cu is batch.prefill_rows.cu  # fla caches its chunk indices by identity
    assert batch.prefill_rows.context_rows(batch.block_tables, BS) is first
    assert batch.prefill_rows.memo("k", list) is batch.prefill_rows.memo("k", lambda: None)
