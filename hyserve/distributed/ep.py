"""Expert-parallel dispatch and combine: the routed experts are split over the EP ranks (rank r holds
experts [r * E / W, (r + 1) * E / W)); each rank sends its tokens' (token, slot) rows to the ranks owning
their experts with one uneven all-to-all, the owners run their experts, and a second all-to-all brings
the rows back to be weighted and summed.

Under the reference plan, bit-exact with the single-device reference (ops/moe.py `experts_forward`) in
fp32: when the ranks dispatch consecutive token chunks in rank order, the rows an expert receives, stably
sorted by expert, are exactly the rows of that expert there, in the same order (so the same GEMM), and the
k contributions of a token are summed in slot order by the same expression. A GPU plan picks each rank's
kernel by the pairs it receives, as the single-device block picks by its own.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hyserve.distributed.comm import Group
from hyserve.ops import moe as moe_ops
from hyserve.ops.dispatch import records_grad
from hyserve.ops.kernel_plan import KernelPlan, active


def local_experts_forward(
    x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
    act: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], plan: KernelPlan | None = None,
) -> torch.Tensor:
    """`experts_forward` over this rank's experts (or expert slices) by the kernel `plan` picks for the
    token-expert pairs, as the single-device MoE block does (the decode GEMV, the Triton grouped GEMM,
    torch._grouped_mm under autograd, or the reference)."""
    kernel = active(plan).moe_experts(ids.numel(), x.dtype, records_grad(x, w13, w2))
    if kernel == "gemv":
        from hyserve.ops.moe_gemv import experts_forward_gemv as fn
    elif kernel == "triton":
        from hyserve.ops.moe_triton import experts_forward_triton as fn
    elif kernel == "grouped_mm" and x.shape[0]:
        from hyserve.ops.moe_grouped import experts_forward_grouped as fn
    else:
        fn = moe_ops.experts_forward
    return fn(x, ids, weights, w13, w2, act)


def ep_experts_forward(
    x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
    act: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], group: Group, plan: KernelPlan | None = None,
) -> torch.Tensor:
    """y[t] = sum_j weights[t, j] * E_{ids[t, j]}(x[t]) for this rank's tokens x [n, D] (n may be 0),
    with this rank's experts w13 [E / W, 2I, D], w2 [E / W, D, I], by the kernels of `plan`. Every EP rank
    must call it (a rank with no token sends and receives nothing, but joins both all-to-alls)."""
    n, k = ids.shape
    per_rank = w13.shape[0]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # (expert, token, slot) order, so grouped by owner rank
    expert = flat[order]
    send = torch.bincount(expert // per_rank, minlength=group.size).tolist()
    recv = group.exchange_counts(send)
    rows = group.all_to_all(x[order // k], send, recv)
    local_ids = group.all_to_all(expert % per_rank, send, recv)
    # weight 1 and one slot per row: each row's expert output, in the order the rows came
    ones = torch.ones(rows.shape[0], 1, dtype=torch.float32, device=x.device)
    out = local_experts_forward(rows, local_ids[:, None], ones, w13, w2, act, plan)
    back = group.all_to_all(out, recv, send)
    per_slot = torch.empty_like(back)
    per_slot[order] = back
    per_slot = per_slot.float().view(n, k, w2.shape[1])
    return (per_slot * weights.float().unsqueeze(-1)).sum(1).to(x.dtype)
