"""A fresh prompt's MLA attention on the length ladder (`ops/mla_fresh`): the appended rows change none of
the prompt's rows, every length lands on a rung, and the warm-up's plan pass runs every rung a step can
reach. On the CPU the ladder is forced (it applies where SDPA may take cuDNN)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from dsa_util import paged_pool

from hyserve.ops import mla_decode, mla_fresh
from hyserve.ops.mla_fresh import FRESH_ROWS, build_fresh_plans, fresh_attention, fresh_len


@pytest.mark.parametrize("n", [1, 5, FRESH_ROWS - 1, FRESH_ROWS, FRESH_ROWS + 3])
def test_appended_rows_change_no_row_of_the_prompt(n):
    gen = torch.Generator().manual_seed(n)
    q, k, v = (torch.randn(n, 3, 16, generator=gen) for _ in range(3))
    want = F.scaled_dot_product_attention(*(x.transpose(0, 1) for x in (q, k, v)), is_causal=True).transpose(0, 1)
    got = fresh_attention(q, k, v, 16**-0.5)
    assert got.shape == (n, 3, 16)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_every_length_lands_on_the_next_rung():
    assert [fresh_len(n) for n in (1, FRESH_ROWS - 1, FRESH_ROWS, FRESH_ROWS + 1)] == [FRESH_ROWS] * 3 + [2 * FRESH_ROWS]
    assert all(fresh_len(n) % FRESH_ROWS == 0 and 0 <= fresh_len(n) - n < FRESH_ROWS for n in range(1, 3000, 7))


def test_the_plan_pass_runs_every_rung_a_prompt_of_the_budget_reaches(monkeypatch):
    seen = []
    monkeypatch.setattr(mla_fresh, "fresh_attention", lambda q, k, v, scale, rows: seen.append(rows))
    build_fresh_plans(2, 8, torch.float32, torch.device("cpu"), 3 * FRESH_ROWS + 1)
    assert seen == [FRESH_ROWS * i for i in range(1, 5)]
    assert {fresh_len(n) for n in range(1, 3 * FRESH_ROWS + 2)} <= set(seen)


def test_prefill_of_fresh_prompts_on_the_ladder_equals_the_plain_causal_calls(monkeypatch):
    H, DN, DR, DV, R = 4, 16, 8, 16, 32
    gen = torch.Generator().manual_seed(0)
    ql, cl = [13, 5, 300], [13, 40, 300]  # two fresh prompts beside a chunk over a cached context
    pages, bt = paged_pool(cl, R + DR, torch.float32, bs=8)
    pages.normal_(generator=gen)
    kvb = torch.randn(H * (DN + DV), R, generator=gen) * 0.2
    qn, qr = torch.randn(sum(ql), H, DN, generator=gen), torch.randn(sum(ql), H, DR, generator=gen)
    args = (qn, qr, pages, 1, bt, ql, cl, kvb, R, DV, (DN + DR) ** -0.5)
    want = mla_decode.mla_prefill_fast(*args, split=False)
    rows = []
    monkeypatch.setattr(mla_decode, "pads_fresh", lambda q: True)
    monkeypatch.setattr(mla_decode, "fresh_attention",
                        lambda q, k, v, scale: rows.append(q.shape[0]) or fresh_attention(q, k, v, scale))
    got = mla_decode.mla_prefill_fast(*args, split=False)
    assert rows == [13, 300]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
