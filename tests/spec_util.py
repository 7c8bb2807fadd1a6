"""Helpers of the speculative-decoding tests: a chi-square goodness-of-fit p-value without scipy."""

from __future__ import annotations

import torch


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """P-value of observed `counts` against `probs` over the cells where probs > 0 (Pearson's statistic,
    survival function of chi-square with cells - 1 degrees of freedom: the regularised upper gamma)."""
    support = probs > 0
    n = counts.sum().double()
    expected = probs[support].double() * n
    stat = ((counts[support].double() - expected) ** 2 / expected).sum()
    df = int(support.sum()) - 1
    if df < 1:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))
