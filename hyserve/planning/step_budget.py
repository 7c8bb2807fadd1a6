"""The token budget of a step and the chunk of a long prefill, chosen from the step cost model.

A step reads the weights once whatever it computes (all the routed experts once it holds a few hundred
tokens), so a prefill chunk pays for itself only when its GEMMs take at least that long. The *ridge* is
the chunk size where a fresh prefill's compute time equals the step's weight read plus the step's fixed
overhead. Then:

- `long_prefill_token_threshold` (vLLM's name): the ridge rounded up to a power of two; a chunk of that
  size alone keeps a step compute-bound, and a long prompt takes no more than it while others wait or run,
  so several prefills and the decodes advance together instead of one prompt holding every step;
- `max_num_batched_tokens`: two such chunks (a step with two long prefills, or one and the decodes, is
  still compute-bound), at least today's 2,048 and the running set, at most 16,384. On the 48B shape on
  an H200 this gives 4,096 and 8,192, vLLM's default on large GPUs.

A device without known ceilings (the CPU) keeps what hyserve chose before: 2,048 tokens and no cap.
"""

from __future__ import annotations

from dataclasses import dataclass

from hyserve.config import LEGACY_STEP_BUDGET
from hyserve.planning.ceilings import DeviceCeilings
from hyserve.planning.step_cost import StepCostModel, StepShape

MAX_BUDGET = 16384


@dataclass(frozen=True)
class StepBudget:
    max_num_batched_tokens: int
    long_prefill_token_threshold: int  # 0: no cap
    reason: str


def ridge_tokens(model: StepCostModel, ceil: DeviceCeilings, limit: int = 1 << 20) -> int:
    """The smallest fresh prefill chunk whose GEMM and attention time covers the weight read and the
    step overhead (`limit` when none up to it does)."""

    def compute_bound(t: int) -> bool:
        cost = model.cost(StepShape(prefill=t))
        return cost.flops / ceil.matmul_flops_per_s >= cost.bytes / ceil.copy_bytes_per_s + ceil.step_overhead_s

    lo, hi = 1, limit
    if not compute_bound(hi):
        return limit
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if compute_bound(mid) else (mid + 1, hi)
    return lo


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def choose_step_budget(model: StepCostModel, ceil: DeviceCeilings | None, max_num_seqs: int,
                       budget: int | None = None, threshold: int | None = None) -> StepBudget:
    """Fill in the budget and the threshold the user left unset (None); the given ones are kept."""
    if ceil is None:
        b = budget if budget is not None else LEGACY_STEP_BUDGET
        return StepBudget(b, threshold or 0, "no step cost model for this device: hyserve's earlier defaults")
    ridge = ridge_tokens(model, ceil)
    chunk = _pow2_at_least(ridge)
    if budget is None:
        budget = max(min(2 * chunk, MAX_BUDGET), LEGACY_STEP_BUDGET, max_num_seqs)
    if threshold is None:
        threshold = chunk if chunk < budget else 0
    w = model.weight_bytes(ridge)
    gemm = model.cost(StepShape(prefill=ridge)).flops / ridge / ceil.matmul_flops_per_s
    reason = (f"step cost model on {ceil.describe()}: a step reads {w / 1e9:.1f} GB of weights "
              f"({w / ceil.copy_bytes_per_s * 1e3:.1f} ms) and a prefill token computes for {gemm * 1e6:.2f} us, "
              f"so a chunk is compute-bound from {ridge} tokens")
    return StepBudget(budget, threshold, reason)
