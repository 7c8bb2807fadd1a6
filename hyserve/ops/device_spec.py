"""What the kernel plan reads of a device (hyserve/ops/kernel_plan.py): its kind, compute capability, SM
count and which kernel libraries are importable. `DeviceSpec.of()` describes a real device; tests
describe others (`H200`) to check the plan on machines without one."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from hyserve.ops.dispatch import has_fla, has_triton


@functools.cache
def has_gluon() -> bool:
    try:
        from hyserve.ops import mla_decode_wgmma  # noqa: F401 - Triton's Gluon dialect
    except ImportError:
        return False
    return True


@dataclass(frozen=True)
class DeviceSpec:
    """What the plan reads of a device; `of()` describes a real one, tests describe others."""

    type: str = "cpu"
    name: str = "cpu"
    capability: tuple[int, int] = (0, 0)
    sm_count: int = 0
    triton: bool = False
    fla: bool = False
    gluon: bool = False
    grouped_mm: bool = False  # torch._grouped_mm

    @classmethod
    def of(cls, device: torch.device | str) -> DeviceSpec:
        device = torch.device(device)
        if device.type != "cuda":
            return cls(device.type, device.type)
        props = torch.cuda.get_device_properties(device)
        return cls("cuda", props.name, torch.cuda.get_device_capability(device), props.multi_processor_count,
                   has_triton(), has_fla(), has_gluon(), hasattr(torch, "_grouped_mm"))

    def describe(self) -> str:
        if self.type != "cuda":
            return self.name
        return f"{self.name} (sm_{self.capability[0]}{self.capability[1]}, {self.sm_count} SMs)"


# an H200 as the plan sees it, for tests of the plan on machines without one
H200 = DeviceSpec("cuda", "NVIDIA H200 (described)", (9, 0), 132, True, True, True, True)

