"""The DSA top-k merge under DCP on gloo processes: each rank ranks only the positions it owns, and the
merged selection equals the single-process top-k (ops/dsa_indexer.py `topk_causal`), order included,
under heavy ties, with k larger than a rank's tokens (and than the context), and when a rank's whole
sent list survives and it must resend."""

from __future__ import annotations

import pytest
import torch
from dist_util import rank_pool

from hyserve.distributed import ParallelConfig
from hyserve.distributed.dcp import TokenOwnership
from hyserve.distributed.dsa_dcp import merge_topk
from hyserve.ops import dsa_indexer as dsa


def _merge(state, case: str) -> tuple[bool, int]:
    gen = torch.Generator().manual_seed(11)
    w = state.dcp.size
    if case == "ties":  # 40 positions, three score values
        s, k, scores = 40, 8, None
    elif case == "k_over_rank_tokens":  # 12 positions, 12 / W per rank, k = 8; and k over the context
        s, k, scores = 12, 8 if w == 2 else 16, None
    else:  # rank 0's positions score highest: its whole sent list survives
        s, k = 40, 8
        scores = (TokenOwnership(w, 0).owner(torch.arange(s)) == 0).float().expand(6, s) + torch.rand(6, s, generator=gen)
    qpos = torch.tensor([s - 1, s - 1, s // 2, 3, 0, s - 2])
    if scores is None:
        scores = torch.randint(0, 3, (qpos.numel(), s), generator=gen).float()
    ref = dsa.topk_causal(scores, qpos, k)
    own = TokenOwnership(w, state.dcp.rank)
    mine = torch.arange(s)[own.owner(torch.arange(s)) == own.rank]
    pos = torch.where(mine[None, :] <= qpos[:, None], mine[None, :], -1)
    got, resent = merge_topk(scores[:, mine], pos, k, state.dcp)
    width = ref.shape[1]
    return torch.equal(got[:, :width], ref) and bool((got[:, width:] == -1).all()), resent


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("case", ["ties", "k_over_rank_tokens", "resend"])
def test_merged_topk_equals_one_process(case, world):
    layout = ParallelConfig(tensor_parallel_size=world, decode_context_parallel_size=world)
    out = rank_pool(world).run(_merge, case, layout=layout)
    assert all(equal for equal, _ in out), out
    assert len({resent for _, resent in out}) == 1  # every rank took the same rounds
    if case == "resend":
        assert out[0][1] > 0


def test_ties_break_by_position_on_every_rank():
    from hyserve.distributed.dsa_dcp import order_candidates

    s, p = order_candidates(torch.tensor([[1.0, 2.0, 2.0, 1.0, 0.5]]), torch.tensor([[7, 9, 3, 2, -1]]))
    assert p.tolist() == [[3, 9, 2, 7, -1]] and s[0, :4].tolist() == [2.0, 2.0, 1.0, 1.0]
