"""Weights of several projections stacked into one operand for the GPU fast path: one GEMM reads the
input once and streams every part's rows in one launch (at batch 1 each launch costs a few µs for a few
MB). Built lazily on first use and cached on the layer, keyed by the parts' storage: a reload rebuilds
it. Costs the parts' size again in memory."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def merged(layer: torch.nn.Module, name: str, parts: Sequence[torch.Tensor],
           build: Callable[[list[torch.Tensor]], torch.Tensor] = torch.cat) -> torch.Tensor:
    """build([detached parts]) cached on layer under name (default: the parts concatenated along dim 0)."""
    key = tuple(w.data_ptr() for w in parts)
    cached = getattr(layer, name, None)
    if cached is None or cached[0] != key:
        cached = (key, build([w.detach() for w in parts]))
        setattr(layer, name, cached)
    return cached[1]
