"""The batched MLA prefill of the GPU path (`ops/mla_decode.mla_prefill_fast`) against the expanded-form
reference, run on the CPU: chunks that start at 0 and chunks over a cached context (the causal diagonal
aligned to the chunk's end), several sequences laid end to end."""

from __future__ import annotations

import torch
from dsa_util import paged_pool

from hyserve.ops import mla_attention as ref
from hyserve.ops.mla_decode import mla_prefill_fast

H, DN, DR, DV, R, BS = 4, 16, 8, 16, 32, 8


def test_prefill_chunks_with_and_without_cached_context_match_the_reference():
    gen = torch.Generator().manual_seed(0)
    ql, cl = [13, 5, 1, 9], [13, 40, 17, 9 + 24]  # from 0; over 35 cached rows; one token; over 24
    pages, bt = paged_pool(cl, R + DR, torch.float32, bs=BS)
    pages.normal_(generator=gen)
    kvb = torch.randn(H * (DN + DV), R, generator=gen) * 0.2
    qn, qr = torch.randn(sum(ql), H, DN, generator=gen), torch.randn(sum(ql), H, DR, generator=gen)
    scale = (DN + DR) ** -0.5
    out = mla_prefill_fast(qn, qr, pages, 1, bt, ql, cl, kvb, R, DV, scale)
    q0 = 0
    for i, (nq, nc) in enumerate(zip(ql, cl)):
        rows = ref.gather_rows(pages, 1, bt[i], nc)
        want = ref.mla_expanded(qn[q0 : q0 + nq], qr[q0 : q0 + nq], rows, kvb, R, DV, scale, nc - nq)
        torch.testing.assert_close(out[q0 : q0 + nq], want, rtol=1e-4, atol=1e-5, msg=f"sequence {i}")
        q0 += nq
