"""What a device can move and compute: the ceilings the step cost model (step_cost.py) divides by.

Figures are sustained rates, not datasheet peaks: device-to-device copy bandwidth (read + write counted,
the way a step reads weights once) and the dense bf16 matmul rate of a large GEMM. The H200's are this
project's own measurements rounded down (copy 4.16-4.22 TB/s, matmul 782-790 TFLOP/s in
docs/BENCHMARKS.md); the others are set from the same ratio to their datasheets and are marked as not
measured here. A device without an entry (the CPU, an unknown GPU) has none, and what is chosen from the
cost model falls back to the defaults hyserve had before it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DeviceCeilings:
    name: str
    copy_bytes_per_s: float
    matmul_flops_per_s: float
    # host scheduling plus the kernel launches of one eager mixed step that no kernel hides: what a step
    # of a tiny model costs whatever its size (a graph-replayed batch-1 decode step on the H200 is
    # 2.55 ms against its 1.5 ms floor; eager mixed steps launch several times as many kernels)
    step_overhead_s: float = 2e-3
    measured: bool = False  # the figures come from this project's own runs on the device

    def describe(self) -> str:
        src = "measured" if self.measured else "not measured here"
        return (f"{self.name}: copy {self.copy_bytes_per_s / 1e12:.1f} TB/s, bf16 matmul "
                f"{self.matmul_flops_per_s / 1e12:.0f} TFLOP/s ({src})")


H200 = DeviceCeilings("H200", 4.0e12, 700e12, measured=True)
# (name fragment, ceilings), first match wins: "GH200" before "H200"
KNOWN = (
    ("GH200", DeviceCeilings("GH200", 3.6e12, 700e12)),
    ("H200", H200),
    ("H100", DeviceCeilings("H100", 2.9e12, 650e12)),
    ("A100", DeviceCeilings("A100", 1.7e12, 250e12)),
)


def ceilings_for(device_name: str | None) -> DeviceCeilings | None:
    """The ceilings of a device named like torch names it ("NVIDIA H200"), or None (CPU, unknown)."""
    if not device_name:
        return None
    upper = device_name.upper()
    return next((c for key, c in KNOWN if key in upper), None)
