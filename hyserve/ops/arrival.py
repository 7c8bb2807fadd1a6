"""Arrival counters for kernels whose last program finishes the work (a "last block" reduction).

Programs of such a kernel write their partial results, then add 1 to a counter with acquire-release
order after a block barrier; the program that sees the count reach the number of contributors reads
the results back (skipping L1, which is not coherent across SMs) and finishes, then sets the counter
to 0 again. That saves the launch a second kernel would cost, which inside a decode step's CUDA graph
is several µs for a few KB of work (the KDA output norm, the router's selection).

Launches on one stream never overlap, and each leaves its counters zero, so all such kernels on a
device share one buffer. Calls on one device must therefore not run concurrently (the engine uses one
stream). A captured graph holds a buffer's address for good, so a buffer is never freed: growing adds a
larger one.
"""

from __future__ import annotations

import torch

_BUFFERS: dict[torch.device, list[torch.Tensor]] = {}
_MIN = 1 << 16  # batch 2048 at 32 KDA heads


def arrival_counters(device: torch.device | str, count: int) -> torch.Tensor:
    """At least `count` int32 counters on device, all zero at the launch that gets them."""
    device = torch.device(device)
    bufs = _BUFFERS.setdefault(device, [])
    if bufs and bufs[-1].numel() >= count:
        return bufs[-1]
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        # a buffer made now is zeroed only when the graph replays, so it cannot be shared with eager
        # calls: this launch gets its own, zeroed by a fill captured with it (the eager warm-up before
        # a capture normally grows the shared buffer first)
        return torch.zeros(count, dtype=torch.int32, device=device)
    bufs.append(torch.zeros(max(count, _MIN, 2 * bufs[-1].numel() if bufs else 0), dtype=torch.int32, device=device))
    return bufs[-1]
