"""Arrival counters for kernels whose last program finishes the work (a "last block" reduction).

Programs of such a kernel write their partial results, then add 1 to a counter with acquire-release
order; the program that sees the count reach the grid size reads every partial result back and
finishes, and sets the counter to 0 again. That saves the launch a second kernel would cost, which
inside a decode step's CUDA graph is several µs for a few KB of work. Kernels on one stream run one
after another, so every such kernel can share the same counters; a captured graph replays with the
same addresses, so the buffers are allocated once, before capture, and never freed.
"""

from __future__ import annotations

import torch

_buffers: dict[torch.device, torch.Tensor] = {}
_retired: list[torch.Tensor] = []  # grown-out buffers stay alive: a captured graph may still point at one


def arrival_counters(device: torch.device, n: int) -> torch.Tensor:
    """n zeroed int32 counters on device that every kernel leaves zeroed again."""
    device = torch.device(device)
    buf = _buffers.get(device)
    if buf is None or buf.numel() < n:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("arrival counters must be allocated before CUDA graph capture: run one step first")
        if buf is not None:
            _retired.append(buf)
        buf = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
        _buffers[device] = buf
    return buf[:n]
