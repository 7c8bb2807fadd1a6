"""KDA verify reference (hyserve/ops/kda_verify.py): after a verify step, the slot of column j holds
exactly the state of a plain run over the step's first j+1 tokens (fp32, CPU), recurrent matrix and
conv window alike; the next step picks its start by the accepted count, with no copies."""

from __future__ import annotations

import torch

from hyserve.ops import kda as kda_ops
from hyserve.ops.kda_verify import conv_verify, recurrent_verify

H, K, C, W, SLOTS = 2, 8, 12, 4, 10
SCALE = K**-0.5


def stream(n: int, seed: int) -> dict:
    """n tokens' recurrence inputs of one sequence (float64 where the reference keeps it)."""
    g = torch.Generator().manual_seed(seed)

    def unit(*shape):
        x = torch.randn(*shape, generator=g, dtype=torch.float64)
        return x / x.norm(dim=-1, keepdim=True)

    return dict(q=unit(n, H, K), k=unit(n, H, K), v=torch.randn(n, H, K, generator=g, dtype=torch.float64),
                g=-torch.rand(n, H, K, generator=g, dtype=torch.float64),
                beta=torch.rand(n, H, generator=g, dtype=torch.float64))


def cat(*parts: dict) -> dict:
    return {key: torch.cat([p[key] for p in parts]) for key in parts[0]}


def plain_states(tokens: dict, s0: torch.Tensor) -> list[torch.Tensor]:
    """State after each token of a plain token-by-token run from s0."""
    out, m = [], s0.unsqueeze(0)
    for t in range(tokens["q"].shape[0]):
        _, m = kda_ops.kda_recurrent(*(tokens[x][t : t + 1] for x in ("q", "k", "v", "g", "beta")), m, SCALE)
        out.append(m[0])
    return out


def verify(tokens: dict, pool: torch.Tensor, table: list[list[int]], src: list[int], lens: list[int]) -> torch.Tensor:
    cu = torch.tensor([0] + lens).cumsum(0)
    return recurrent_verify(*(tokens[x] for x in ("q", "k", "v", "g", "beta")), pool, torch.tensor(table),
                            torch.tensor(src), cu, SCALE)


def fresh_pool(seed: int = 9) -> torch.Tensor:
    return torch.randn(SLOTS, H, K, K, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 0.3


def test_each_column_holds_the_state_after_that_many_tokens():
    pool = fresh_pool()
    s0 = pool[2].clone()
    step = stream(4, seed=1)  # the last sampled token and 3 drafts
    out = verify(step, pool, [[2, 5, 7, 3]], [0], [4])
    expected = plain_states(step, s0)
    for j, slot in enumerate([2, 5, 7, 3]):
        assert torch.allclose(pool[slot], expected[j], atol=1e-12)
    o_plain, _ = kda_ops.kda_recurrent_seq(*(step[x] for x in ("q", "k", "v", "g", "beta")), s0, SCALE)
    assert torch.allclose(out, o_plain.double(), atol=1e-12)


def test_the_next_step_starts_from_the_accepted_column_and_equals_a_plain_run_over_accepted_tokens():
    table = [[4, 0, 8, 1]]
    for accepted in range(4):  # drafts accepted in step 1: the state after 1 + accepted tokens
        pool = fresh_pool()
        s0 = pool[4].clone()
        step1, step2 = stream(4, seed=2), stream(3, seed=3)
        verify(step1, pool, table, [0], [4])
        verify(step2, pool, table, [accepted], [3])
        kept = {x: step1[x][: accepted + 1] for x in step1}
        expected = plain_states(cat(kept, step2), s0)[accepted + 1 :]
        for j in range(3):
            assert torch.allclose(pool[table[0][j]], expected[j], atol=1e-12), (accepted, j)


def test_a_step_without_drafts_after_a_speculative_step_reads_the_accepted_column():
    """Regression (vllm#39273): a plain one-token step after a speculative one must start from the
    state of the accepted tokens (column 2 here), not from column 0."""
    pool = fresh_pool()
    table = [[6, 2, 9]]
    s0 = pool[6].clone()
    step1, plain = stream(3, seed=4), stream(1, seed=5)
    verify(step1, pool, table, [0], [3])
    assert not torch.allclose(pool[6], pool[9])  # the columns differ, so reading the wrong one shows
    verify(plain, pool, table, [2], [1])
    assert torch.allclose(pool[6], plain_states(cat(step1, plain), s0)[-1], atol=1e-12)


def test_a_batch_of_sequences_writes_only_its_own_slots():
    pool = fresh_pool()
    before = pool.clone()
    a, b = stream(3, seed=6), stream(1, seed=7)
    table = [[1, 3, 5], [7, 0, 2]]
    verify(cat(a, b), pool, table, [1, 2], [3, 1])  # b: a plain decode from its column 2
    assert torch.allclose(pool[1], plain_states(a, before[3])[0], atol=1e-12)
    assert torch.allclose(pool[5], plain_states(a, before[3])[2], atol=1e-12)
    assert torch.allclose(pool[7], plain_states(b, before[2])[0], atol=1e-12)
    untouched = [s for s in range(SLOTS) if s not in (1, 3, 5, 7)]
    assert torch.equal(pool[untouched], before[untouched])


def test_conv_windows_per_column_equal_the_plain_conv_over_the_prefix():
    g = torch.Generator().manual_seed(8)
    pool = torch.randn(SLOTS, C, W - 1, generator=g)
    weight = torch.randn(C, W, generator=g)
    x1, x2 = torch.randn(4, C, generator=g), torch.randn(2, C, generator=g)
    t0 = pool[3].clone()
    table = torch.tensor([[3, 6, 1, 8]])
    y1 = conv_verify(x1, weight, pool, table, torch.tensor([0]), torch.tensor([0, 4]))
    y_plain, _ = kda_ops.short_conv(x1, weight, t0)
    assert torch.allclose(y1, y_plain)
    for j in range(4):
        _, tail = kda_ops.short_conv(x1[: j + 1], weight, t0)
        assert torch.equal(pool[table[0, j]], tail)
    # two drafts accepted: the next step continues from column 2 as a plain conv over the kept tokens
    y2 = conv_verify(x2, weight, pool, table, torch.tensor([2]), torch.tensor([0, 2]))
    y_cont, tail = kda_ops.short_conv(torch.cat([x1[:3], x2]), weight, t0)
    assert torch.allclose(y2, y_cont[3:])
    assert torch.equal(pool[table[0, 1]], tail)
