"""Decode context parallelism for MLA on gloo processes: token ownership and slot mappings, and DCP
attention (all-gathered absorbed queries, attention over the local shard with LSE, LSE combine,
reduce-scatter of heads) equal to one process's MLA for decode rows, multi-token rows at later positions
(chunked prefill, verify), uneven shards and shards that own none of a row's tokens."""

from __future__ import annotations

import pytest
import torch
from dist_util import rank_pool, rel_err

from hyserve.distributed import ParallelConfig
from hyserve.distributed.dcp import TokenOwnership, dcp_mla, write_owned
from hyserve.models.batch import Batch
from hyserve.ops import mla_attention as mla_ops

# (context length, query rows): a 1-token prompt (empty shards on W-1 ranks), a decode, a chunk at
# positions 9-12 of a longer prompt, a fresh prefill, two verify-like rows; lengths uneven over W
SEQS = [(1, 1), (5, 1), (13, 4), (3, 3), (9, 2)]
R, DR, DN, DV, BS, HEADS_PER_RANK = 32, 8, 16, 16, 4, 2


@pytest.mark.parametrize("world,interleave", [(2, 1), (4, 1), (4, 2), (3, 4)])
def test_every_position_has_one_owner_and_round_trips(world, interleave):
    pos = torch.arange(200)
    owners = [TokenOwnership(world, r, interleave) for r in range(world)]
    mine = [o.owner(pos) == o.rank for o in owners]
    assert torch.stack(mine).sum(0).eq(1).all()
    for o, m in zip(owners, mine):
        local = o.local_pos(pos[m])
        assert torch.equal(local, torch.arange(int(m.sum())))  # dense local positions 0, 1, ...
        assert torch.equal(o.global_pos(local), pos[m])
        assert [o.local_len(n) for n in range(60)] == [int(m[:n].sum()) for n in range(60)]


def test_slot_mapping_is_minus_one_off_the_owner():
    batch = Batch.build([6], [6], [[3, 5]], 8, [0], [True])  # blocks of 4 local tokens = 8 global at W = 2
    slots = [TokenOwnership(2, r).slot_mapping(batch, 4).tolist() for r in range(2)]
    assert slots == [[12, -1, 13, -1, 14, -1], [-1, 12, -1, 13, -1, 14]]


def _expanded_fp64(q_nope, q_rope, rows, kv_b, start):
    """mla_ops.mla_expanded's math in float64 (the op itself computes in fp32)."""
    kv = (rows[:, :R] @ kv_b.t()).view(rows.shape[0], -1, DN + DV)
    scores = torch.einsum("qhd,shd->hqs", q_nope, kv[..., :DN]) + torch.einsum("qhd,sd->hqs", q_rope, rows[:, R:])
    future = torch.arange(rows.shape[0])[None, :] > start + torch.arange(q_nope.shape[0])[:, None]
    p = torch.softmax((scores * (DN + DR) ** -0.5).masked_fill(future, float("-inf")), -1)
    return torch.einsum("hqs,shd->qhd", p, kv[..., DN:])


def _attention_error(state, dtype_name: str, interleave: int) -> tuple[float, bool]:
    dt = getattr(torch, dtype_name)
    gen = torch.Generator().manual_seed(5)
    w, heads = state.dcp.size, HEADS_PER_RANK * state.tp.size
    scale = (DN + DR) ** -0.5
    kv_b = (torch.randn(heads * (DN + DV), R, generator=gen) * 0.2).to(dt)
    ctxs, qlens = [c for c, _ in SEQS], [n for _, n in SEQS]
    tables = [list(range(4 * i, 4 * i + 4)) for i in range(len(SEQS))]
    rows = [torch.randn(c, R + DR, generator=gen).to(dt) for c in ctxs]
    q_nope = torch.randn(sum(qlens), heads, DN, generator=gen).to(dt)
    q_rope = torch.randn(sum(qlens), heads, DR, generator=gen).to(dt)
    ref, at = [], 0
    for (c, n), r in zip(SEQS, rows):
        attend = mla_ops.mla_expanded if dt == torch.float32 else _expanded_fp64
        args = (R, DV, scale, c - n) if dt == torch.float32 else (c - n,)
        ref.append(attend(q_nope[at : at + n], q_rope[at : at + n], r, kv_b, *args))
        at += n
    ref = torch.cat(ref).to(dt)
    own = TokenOwnership(w, state.dcp.rank, interleave)
    pages = torch.zeros(4 * len(SEQS), 1, BS, R + DR, dtype=dt)
    history = Batch.build(ctxs, ctxs, tables, BS * w, [0] * len(SEQS), [True] * len(SEQS))
    write_owned(pages, 0, own.slot_mapping(history, BS), torch.cat(rows))
    batch = Batch.build(qlens, ctxs, tables, BS * w, list(range(len(SEQS))), [False] * len(SEQS))
    h = slice(state.tp.rank * HEADS_PER_RANK, (state.tp.rank + 1) * HEADS_PER_RANK)
    kv_b_mine = kv_b.view(heads, DN + DV, R)[h].reshape(-1, R)
    out = dcp_mla(q_nope[:, h], q_rope[:, h], kv_b_mine, pages, 0, batch, own, state.dcp, R, DV, scale)
    return rel_err(out, ref[:, h]), bool(torch.isfinite(out).all())


DCP_LAYOUTS = [(2, 2, 1), (4, 4, 1), (4, 2, 1), (4, 4, 2)]  # (TP, DCP, interleave)


@pytest.mark.parametrize("tp,dcp,interleave", DCP_LAYOUTS)
@pytest.mark.parametrize("dtype,tol", [("float32", 1e-5), ("float64", 1e-12)])
def test_dcp_attention_equals_one_process(tp, dcp, interleave, dtype, tol):
    layout = ParallelConfig(tensor_parallel_size=tp, decode_context_parallel_size=dcp, cp_kv_cache_interleave_size=interleave)
    out = rank_pool(tp).run(_attention_error, dtype, interleave, layout=layout)
    assert all(finite for _, finite in out)
    assert max(e for e, _ in out) < tol, out


def _combine_with_a_nan_empty_shard(state) -> tuple[bool, float]:
    """Rank 0 owns every token; the others' backends returned NaN outputs with lse = -inf (what a kernel
    gives for an empty shard): the combined output is rank 0's, NaN-free."""
    from hyserve.distributed.dcp import combine

    gen = torch.Generator().manual_seed(7)
    w = state.dcp.size
    o0, lse0 = torch.randn(3, 2 * w, R, generator=gen), torch.randn(3, 2 * w, generator=gen)
    if state.dcp.rank == 0:
        o, lse = o0, lse0
    else:
        o, lse = torch.full_like(o0, float("nan")), torch.full_like(lse0, float("-inf"))
    out = combine(o, lse, state.dcp)
    h = slice(2 * state.dcp.rank, 2 * state.dcp.rank + 2)
    return bool(torch.isfinite(out).all()), rel_err(out, o0[:, h])


def test_combine_zeroes_an_empty_shards_nan_output():
    layout = ParallelConfig(tensor_parallel_size=4, decode_context_parallel_size=4)
    out = rank_pool(4).run(_combine_with_a_nan_empty_shard, layout=layout)
    assert all(f for f, _ in out) and max(e for _, e in out) < 1e-6, out


def _model_logits_error(state, preset: str) -> tuple[float, int, int]:
    """(logits error against one process, latent rows this rank stored, rows one process stored)."""
    from dist_util import PAGE_BLOCK, run_steps

    from hyserve.distributed.context import StepContext
    from hyserve.distributed.model import shard_model
    from hyserve.models.loader import load_model

    model = load_model(preset, dtype="float32")
    ref, ref_cache = run_steps(model)
    got, cache = run_steps(shard_model(model, StepContext(state)), batch_block=PAGE_BLOCK * state.dcp.size)
    stored = int(cache.pages.abs().sum(-1).gt(0).sum())
    return max(rel_err(g, r) for g, r in zip(got, ref)), stored, int(ref_cache.pages.abs().sum(-1).gt(0).sum())


@pytest.mark.parametrize("tp,dcp,ep", [(2, 2, False), (4, 4, False), (4, 2, False), (4, 2, True)])
@pytest.mark.parametrize("preset", ["kimi-linear-tiny", "k3-tiny", "k3.1-tiny"])
def test_dcp_model_logits_equal_one_process(preset, tp, dcp, ep):
    layout = ParallelConfig(tensor_parallel_size=tp, decode_context_parallel_size=dcp, enable_expert_parallel=ep)
    out = rank_pool(tp).run(_model_logits_error, preset, layout=layout)
    assert max(e for e, _, _ in out) < 1e-5, out
    # each DCP group stores every latent row once: the ranks of a group together hold what one process holds
    assert sum(s for _, s, _ in out) == (tp // dcp) * out[0][2]
