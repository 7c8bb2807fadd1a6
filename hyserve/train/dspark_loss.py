"""The DSpark drafter's training objective on fixed-shape rows (hyserve/train/rows.py).

Anchors: A positions a per row where the token after a is a training target (assistant or generated
text). Block position j of anchor a predicts x_{a+1+j}; it is supervised while a+j stays inside the
row and every target up to it is trained on (the cumulative mask). With p_d the drafter's teacher-
forced distribution (Markov bias from the true x_{a+j}) and p_t the target's at a+j:

    loss = 0.1 CE(p_d, x_{a+1+j}) + 0.9 |p_d - p_t|_1 + 1.0 BCE(confidence, 1 - |p_d - p_t|_1 / 2)

each position weighted by exp(-j / 4) (DSpark's recipe, DeepSpec's dspark_qwen3_4b config). The metrics
are the acceptance the drafter would get when serving: alpha_j = 1 - |p_d - p_t|_1 / 2 is the
probability that draft j is accepted at temperature 1 given the drafts before it were, so the
expected tokens per verify step is tau = 1 + sum_j prod_{i<=j} alpha_i; the greedy one counts leading
drafts equal to the target's argmax.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hyserve.spec_decode.dspark import DSparkDrafter
from hyserve.train.rows import IGNORE


@dataclass
class LossWeights:
    ce: float = 0.1
    tv: float = 0.9
    confidence: float = 1.0
    decay_gamma: float = 4.0  # position weights exp(-j / gamma)


def sample_anchors(targets: torch.Tensor, num_anchors: int, gen: torch.Generator | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(anchor positions [R, A] sorted, keep [R, A]) drawn without replacement among positions a >= 1
    whose next token is a target; rows with fewer candidates keep only as many."""
    r, length = targets.shape
    ok = targets != IGNORE
    ok[:, 0] = False  # an anchor needs at least one earlier position for context
    score = torch.rand(r, length, generator=gen, device=targets.device)
    score = torch.where(ok, score, 2.0)
    order = score.argsort(dim=1)[:, :num_anchors]
    keep = torch.gather(ok, 1, order)
    pos = torch.where(keep, order, 0)
    pos, idx = pos.sort(dim=1)
    return pos, torch.gather(keep, 1, idx)


def block_index(anchor_pos: torch.Tensor, block: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions a+j clamped into the row [R, A, γ], inside-the-row mask)."""
    pos = anchor_pos.unsqueeze(-1) + torch.arange(block, device=anchor_pos.device)
    return pos.clamp(max=length - 1), pos < length


def supervised(targets: torch.Tensor, pos: torch.Tensor, inside: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """[R, A, γ] bool: position j is trained on while every target of the block up to it is."""
    t = torch.gather(targets, 1, pos.flatten(1)).view(pos.shape)
    valid = (t != IGNORE) & inside & keep.unsqueeze(-1)
    return valid.int().cumprod(dim=-1).bool()


def context_visible(anchor_pos: torch.Tensor, block: int, length: int) -> torch.Tensor:
    """[R, A*γ, L]: each block's queries see the target features of positions before its anchor."""
    a = anchor_pos.repeat_interleave(block, dim=1)
    return torch.arange(length, device=anchor_pos.device) < a.unsqueeze(-1)


def draft_loss(drafter: DSparkDrafter, ids: torch.Tensor, targets: torch.Tensor, features: torch.Tensor,
               target_logits: torch.Tensor, anchor_pos: torch.Tensor, keep: torch.Tensor,
               w: LossWeights) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """ids, targets [R, L]; features [R, L, m*D] (target layers); target_logits [R, A, γ, V] at the block
    positions; anchor_pos, keep [R, A]. Returns (loss, detached metrics)."""
    r, length = ids.shape
    g = drafter.config.block_size
    pos, inside = block_index(anchor_pos, g, length)
    mask = supervised(targets, pos, inside, keep)
    positions = torch.arange(length, device=ids.device).expand(r, -1)
    ctx = drafter.context_rows(features, positions)
    anchors = torch.gather(ids, 1, anchor_pos)
    hidden = drafter.hidden(anchors, anchor_pos, ctx, context_visible(anchor_pos, g, length))
    prev = torch.gather(ids, 1, pos.flatten(1))  # x_{a+j}: the token before each prediction
    logits = drafter.teacher_forced_logits(hidden, prev).view(*pos.shape, -1)
    labels = torch.gather(targets, 1, pos.flatten(1)).view(pos.shape).clamp(min=0)
    p_d, p_t = logits.softmax(-1), target_logits.float().softmax(-1)
    l1 = (p_d - p_t).abs().sum(-1)
    alpha = (1 - 0.5 * l1).clamp(0, 1)
    conf = drafter.confidence_logits(hidden, prev).view(pos.shape)
    weight = torch.exp(-torch.arange(g, device=ids.device) / w.decay_gamma) * mask
    denom = weight.sum().clamp_min(1e-6)
    ce = F.cross_entropy(logits.flatten(0, 2), labels.flatten(), reduction="none").view(pos.shape)
    bce = F.binary_cross_entropy_with_logits(conf, alpha.detach(), reduction="none")
    loss = (w.ce * (ce * weight).sum() + w.tv * (l1 * weight).sum() + w.confidence * (bce * weight).sum()) / denom
    with torch.no_grad():
        metrics = acceptance_metrics(logits, target_logits, alpha, mask, keep)
        metrics.update(ce=(ce * weight).sum() / denom, tv=(l1 * weight).sum() / denom,
                       confidence=(bce * weight).sum() / denom)
    return loss, metrics


def acceptance_metrics(logits: torch.Tensor, target_logits: torch.Tensor, alpha: torch.Tensor,
                       mask: torch.Tensor, keep: torch.Tensor) -> dict[str, torch.Tensor]:
    """Mean tokens per verify step over kept anchors: at temperature 1 (expected, from alpha) and greedy
    (leading drafts equal to the target's argmax), plus the conditional acceptance at each position."""
    m = mask.float()
    blocks = keep.float().sum().clamp_min(1)
    tau_t1 = 1 + ((alpha * m).cumprod(-1) * m).sum(-1)
    match = (logits.argmax(-1) == target_logits.argmax(-1)).float() * m
    tau_greedy = 1 + match.cumprod(-1).sum(-1)
    per_pos = (alpha * m).sum((0, 1)) / m.sum((0, 1)).clamp_min(1)
    return {"tau_t1": (tau_t1 * keep).sum() / blocks, "tau_greedy": (tau_greedy * keep).sum() / blocks,
            "accept_at": per_pos}
