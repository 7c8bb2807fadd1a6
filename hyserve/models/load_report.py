"""What loading the weights cost: time, bytes read and their rate, host memory at its peak and device
memory, measured around one load and written to the start-up log. `hyserve serve` users read it to tell a
slow disk from a slow loader; benchmarks/gpu_load.py reads the same fields."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from hyserve.models import host_memory

GB, GIB = 1e9, 1 << 30
# the loader's host-memory budget while loading: 1.5x the largest shard (one shard mapped in plus the
# tensor being copied out of it) plus 2 GiB for the allocator and the runtime
HOST_SHARD_FACTOR, HOST_SLACK = 1.5, 2 * GIB


@dataclass
class LoadReport:
    load_format: str
    weight_bytes: int  # the model's parameters, as allocated
    read_bytes: int = 0  # checkpoint file bytes (0 for dummy weights)
    num_files: int = 0
    largest_file_bytes: int = 0
    seconds: float = 0.0
    host_rss_before: int | None = None
    host_peak: int | None = None  # high-water mark while loading (the process's, where it cannot be reset)
    device_allocated: int | None = None  # torch's allocated bytes on a CUDA device after loading
    device_peak: int | None = None

    @property
    def gbps(self) -> float:
        return (self.read_bytes or self.weight_bytes) / GB / max(self.seconds, 1e-9)

    @property
    def host_bound(self) -> int:
        return int(HOST_SHARD_FACTOR * self.largest_file_bytes + HOST_SLACK)

    @property
    def host_increase(self) -> int | None:
        if self.host_peak is None or self.host_rss_before is None:
            return None
        return max(0, self.host_peak - self.host_rss_before)

    def describe(self) -> str:
        if self.load_format == "dummy":
            head = f"Initialised {self.weight_bytes / GB:.2f} GB of random weights (load format dummy) in {self.seconds:.2f} s"
        else:
            head = (f"Loaded {self.read_bytes / GB:.2f} GB from {self.num_files} file(s) in {self.seconds:.2f} s "
                    f"({self.gbps:.2f} GB/s, load format {self.load_format})")
        parts = [head]
        if self.host_increase is not None:
            bound = f", bound {self.host_bound / GIB:.2f} GiB" if self.num_files else ""
            parts.append(f"host memory peak +{self.host_increase / GIB:.2f} GiB over {self.host_rss_before / GIB:.2f} GiB{bound}")
        if self.device_allocated is not None:
            parts.append(f"device memory {self.device_allocated / GB:.2f} GB allocated (peak {self.device_peak / GB:.2f} GB) "
                         f"for {self.weight_bytes / GB:.2f} GB of weights")
        return "; ".join(parts)


class LoadMeter:
    """`with LoadMeter(model, fmt, files) as m: ...` then `m.report`: wall time and memory around the block."""

    def __init__(self, model: torch.nn.Module, load_format: str, file_sizes: list[int] = ()) -> None:
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        self.report = LoadReport(load_format, weights, sum(file_sizes), len(file_sizes), max(file_sizes, default=0))
        self.cuda = next(model.parameters()).device.type == "cuda"

    def __enter__(self) -> LoadMeter:
        self.report.host_rss_before = host_memory.rss_bytes()
        host_memory.reset_peak_rss()
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        r = self.report
        r.seconds = time.perf_counter() - self.start
        r.host_peak = host_memory.peak_rss_bytes()
        if self.cuda:
            r.device_allocated, r.device_peak = torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()
