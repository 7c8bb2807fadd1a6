"""A fresh prompt's MLA attention on a length ladder, so that no request waits for a cuDNN plan.

cuDNN's flash kernel (what SDPA picks for a causal call on the H200) builds an execution plan for every
new shape, about 42 ms each, once per process. A fresh prompt of a length the process has not seen paid
that before its first layer's attention ran: a first 1,024-token request took 2.5x its steady TTFT.

Exact: under the causal mask query i reads keys 0..i only, so rows appended after a prompt's last one
change none of its rows. A prompt of n tokens runs as `fresh_len(n)` rows (the next multiple of
FRESH_ROWS; at most FRESH_ROWS - 1 extra rows, under 3% of an 8K prompt's attention) and the warm-up
builds the plan of every rung up to the step budget (`build_fresh_plans`).
"""

from __future__ import annotations

import time

import torch

FRESH_ROWS = 256  # the ladder's step: 33 rungs (33 plans, 1.1 s at start-up on the 48B shape) up to an 8,192-token budget


def pads_fresh(q: torch.Tensor) -> bool:
    """Whether fresh prompts take the ladder: where SDPA may run cuDNN (the CPU's kernels build no plans)."""
    return q.is_cuda and torch.backends.cuda.cudnn_sdp_enabled()


def fresh_len(n: int) -> int:
    return -(-n // FRESH_ROWS) * FRESH_ROWS


def fresh_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, rows: int | None = None
                    ) -> torch.Tensor:
    """Causal attention of one fresh prompt's rows (q, k, v [n, H, d], one width d) computed over `rows` >= n
    rows (default `fresh_len(n)`), the appended rows zero; returns [n, H, d]."""
    import torch.nn.functional as F

    n = q.shape[0]
    rows = fresh_len(n) if rows is None else rows
    if rows != n:
        q, k, v = (F.pad(x, (0, 0, 0, 0, 0, rows - n)) for x in (q, k, v))
    o = F.scaled_dot_product_attention(*(x.transpose(0, 1).unsqueeze(0) for x in (q, k, v)), is_causal=True,
                                       scale=scale)
    return o[0, :, :n].transpose(0, 1)


def build_fresh_plans(heads: int, dim: int, dtype: torch.dtype, device: torch.device, max_tokens: int) -> float:
    """Run every rung's shape up to `max_tokens` once (its cuDNN plan built); returns the seconds taken."""
    t0 = time.perf_counter()
    for rows in range(FRESH_ROWS, fresh_len(max_tokens) + 1, FRESH_ROWS):
        x = torch.zeros(rows, heads, dim, dtype=dtype, device=device)
        fresh_attention(x, x, x, dim**-0.5, rows)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0
