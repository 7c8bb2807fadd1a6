"""Sampled tokens read back to the host behind the step that made them.

A blocking `.tolist()` of a CUDA tensor waits for everything queued on the stream. Under async scheduling
the next step's forward is queued by then, so reading step k's tokens that way waited for step k+1 too,
and the host work it was meant to hide ran with the GPU idle (measured on an H200: no gain at batch 1 or 64).
Here the copies to pinned memory are queued right after the sampler and an event marks them; reading
waits for that event only.
"""

from __future__ import annotations

import torch


class Readback:
    """Host copies of some device tensors, started at construction; `lists()` waits for them."""

    def __init__(self, tensors: dict[str, torch.Tensor | None]):
        self.event: torch.cuda.Event | None = None
        self.host: dict[str, torch.Tensor | None] = {}
        for name, t in tensors.items():
            if t is not None and t.is_cuda:
                host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                host.copy_(t, non_blocking=True)
                t = host
                if self.event is None:
                    self.event = torch.cuda.Event()
            self.host[name] = t
        if self.event is not None:
            self.event.record()

    def lists(self) -> dict[str, list | None]:
        if self.event is not None:
            self.event.synchronize()
        return {name: None if t is None else t.tolist() for name, t in self.host.items()}
