"""Confidence-scheduled verification: verify only the drafts worth a target position (DSpark §3.2).

A drafter with a confidence head predicts c_j, the probability that draft j is accepted given the
drafts before it; the survival s_j = c_0 · ... · c_j is the probability that drafts 0..j all are.
Verifying fewer drafts never changes what the target says as long as the choice of whether draft j is
verified uses no information from x_j itself: then the verified prefix is a stopping rule of the draft
sequence, each verified position is still accepted with min(1, p/q) and the first unverified one is
sampled from the target. A confidence that looks at x_j (the "retrospective" rule: verify x_j because
it looks good) biases the output toward tokens the drafter likes (tests/test_spec_confidence.py has
the counterexample). DSpark's confidence head reads h_j and x_{j-1}, never x_j.

Three admission rules, all causal in that sense:
- `threshold_lengths`: per request, the longest prefix whose survival clears a threshold;
- `top_capacity_lengths`: across the batch, the `capacity` drafts of highest survival, for a capacity
  fixed before these drafts were drawn (a draft's admission then depends only on drafts ranked above
  it, and a request's later drafts never rank above its earlier ones);
- `best_capacity`: the hardware-aware budget (DSpark Algorithm 1) that maximises expected tokens per
  second on a measured steps-per-second curve, to be computed on an earlier step's confidences and
  used as the next step's capacity (the causal barrier of DSpark §5.2).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor


def survival(confidence: Tensor, num_drafts: Sequence[int] | None = None) -> Tensor:
    """[B, K] probability that drafts 0..j are all accepted; 0 past each request's own drafts."""
    s = confidence.double().clamp(0.0, 1.0).cumprod(dim=-1)
    if num_drafts is not None:
        width = torch.arange(confidence.shape[-1], device=confidence.device)
        s = s.masked_fill(width >= torch.tensor(num_drafts, device=confidence.device).unsqueeze(1), 0.0)
    return s


def threshold_lengths(confidence: Tensor, threshold: float, num_drafts: Sequence[int] | None = None) -> Tensor:
    """[B] drafts to verify: how many leading drafts have survival >= threshold (survival never rises,
    so this is a prefix). confidence[:, j] must not depend on draft j."""
    return (survival(confidence, num_drafts) >= threshold).sum(dim=-1)


def _ranked(s: Tensor) -> tuple[Tensor, Tensor]:
    """(request, position) of every positive survival, highest first; ties: earlier position, then lower
    request, so a request's drafts are always ranked in their own order."""
    b, k = s.shape
    req = torch.arange(b, device=s.device).repeat_interleave(k)
    pos = torch.arange(k, device=s.device).repeat(b)
    flat = s.reshape(-1)
    keep = flat > 0
    req, pos, flat = req[keep], pos[keep], flat[keep]
    perm = torch.argsort(pos * b + req)  # position-major, then request
    perm = perm[torch.argsort(-flat[perm], stable=True)]
    return req[perm], pos[perm]


def top_capacity_lengths(confidence: Tensor, capacity: int, num_drafts: Sequence[int] | None = None) -> Tensor:
    """[B] drafts to verify when the batch may verify `capacity` drafts in all: the highest survivals."""
    s = survival(confidence, num_drafts)
    req, pos = _ranked(s)
    lengths = torch.zeros(s.shape[0], dtype=torch.long, device=s.device)
    if capacity > 0 and req.numel():
        take = slice(0, capacity)
        lengths.scatter_reduce_(0, req[take], pos[take] + 1, reduce="amax")
    return lengths


def best_capacity(confidence: Tensor, steps_per_second: Callable[[int], float],
                  num_drafts: Sequence[int] | None = None) -> int:
    """The draft budget that maximises expected emitted tokens x steps per second, admitting drafts by
    survival: tokens = B + sum of admitted survivals (each request emits at least one), and a verify
    step of B + n target positions runs steps_per_second(B + n) times a second. Stops at the first
    admission that lowers the rate (DSpark Algorithm 1's early stop)."""
    s = survival(confidence, num_drafts)
    b = s.shape[0]
    req, pos = _ranked(s)
    flat = s[req, pos].tolist()
    tokens, best, best_n = float(b), float(b) * steps_per_second(b), 0
    for n, value in enumerate(flat, start=1):
        tokens += value
        rate = tokens * steps_per_second(b + n)
        if rate <= best:
            break
        best, best_n = rate, n
    return best_n
