"""Shared facts behind kernel choice: which kernel libraries are importable, the compute capability, and
the `reference_ops()` switch. The layers take their kernels from the model's kernel plan
(ops/kernel_plan.py, docs/ARCHITECTURE.md §7); elementwise ops with no choice to plan (the RMSNorm kernel)
ask `fast_path` per call. The torch references stay the specification; tests switch the kernels off to
compute them on the same device."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
from collections.abc import Iterator

import torch

from hyserve import envs

_forced_reference = False  # inside reference_ops()


@functools.cache
def has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


@functools.cache
def has_fla() -> bool:
    return importlib.util.find_spec("fla") is not None


def references_forced() -> bool:
    """Inside `reference_ops()`, or HYSERVE_REFERENCE_OPS=1."""
    return _forced_reference or envs.get().reference_ops


def fast_path(x: torch.Tensor) -> bool:
    """True where the Triton kernels may run on x (a CUDA tensor, Triton present, not forced off)."""
    return x.is_cuda and not references_forced() and has_triton()


def records_grad(*tensors: torch.Tensor) -> bool:
    """Whether autograd records through any of `tensors`: kernels without a backward then stand aside
    (training on the GPU keeps the torch reference there)."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def no_grad_fast_path(x: torch.Tensor, *params: torch.Tensor) -> bool:
    """fast_path(x) for a kernel without a backward: off while autograd records through x or params."""
    return fast_path(x) and not records_grad(x, *params)


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    # asked about 150 times per eager decode step of the 48B model: torch's query walks the device
    # properties each time (about 1 ms of host time per step on the device, in a cProfile of 2026-12-02)
    return torch.cuda.get_device_capability(index)


def capability(x: torch.Tensor) -> tuple[int, int]:
    """The compute capability of CUDA tensor x's device, asked of torch once per device."""
    return _capability(x.get_device())


def sm90(x: torch.Tensor) -> bool:
    """x on a CUDA GPU of compute capability 9.0 or later (Hopper: programmatic dependent launch, bulk
    prefetch, wgmma)."""
    return x.is_cuda and capability(x) >= (9, 0)


def use_pdl(x: torch.Tensor, pdl: bool | None, default: bool = True) -> bool:
    """Whether to launch as a programmatic dependent: `pdl` if given, else `default` where sm_90+ has it;
    never off CUDA (griddepcontrol is inline PTX, which the CPU interpreter cannot run)."""
    return x.is_cuda and (default and sm90(x) if pdl is None else pdl)


def pow2_dims(*dims: int) -> bool:
    """Whether every dim is a power of two: the Triton kernels span a head or latent row with one
    tl.arange, which must be. Layers with other widths (small test checkpoints) take the torch path."""
    return all(d > 0 and d & (d - 1) == 0 for d in dims)


@contextlib.contextmanager
def reference_ops() -> Iterator[None]:
    """Run the torch reference ops inside this block, even on CUDA tensors."""
    global _forced_reference
    old, _forced_reference = _forced_reference, True
    try:
        yield
    finally:
        _forced_reference = old
