"""When the layers take the GPU fast path (DESIGN.md §6): CUDA tensors, the kernel libraries importable,
and no `reference_ops()` block active. The torch references stay the specification; tests switch the
fast path off to compute them on the same device."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
from collections.abc import Iterator

import torch

_forced_reference = os.environ.get("HYSERVE_REFERENCE_OPS", "0") == "1"


@functools.cache
def has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


@functools.cache
def has_fla() -> bool:
    return importlib.util.find_spec("fla") is not None


def fast_path(x: torch.Tensor) -> bool:
    """True where the Triton kernels may run on x (a CUDA tensor, Triton present, not forced off)."""
    return x.is_cuda and not _forced_reference and has_triton()


def no_grad_fast_path(x: torch.Tensor, *params: torch.Tensor) -> bool:
    """fast_path(x) for a kernel without a backward: off while autograd records through x or params
    (training on the GPU keeps the torch reference there)."""
    return fast_path(x) and not (torch.is_grad_enabled() and any(t.requires_grad for t in (x, *params)))


def sm90(x: torch.Tensor) -> bool:
    """x on a CUDA GPU of compute capability 9.0 or later (Hopper: programmatic dependent launch, bulk
    prefetch, wgmma)."""
    return x.is_cuda and torch.cuda.get_device_capability(x.device) >= (9, 0)


def use_pdl(x: torch.Tensor, pdl: bool | None, default: bool = True) -> bool:
    """Whether to launch as a programmatic dependent: `pdl` if given, else `default` where sm_90+ has it;
    never off CUDA (griddepcontrol is inline PTX, which the CPU interpreter cannot run)."""
    return x.is_cuda and (default and sm90(x) if pdl is None else pdl)


def pow2_dims(*dims: int) -> bool:
    """Whether every dim is a power of two: the Triton kernels span a head or latent row with one
    tl.arange, which must be. Layers with other widths (small test checkpoints) take the torch path."""
    return all(d > 0 and d & (d - 1) == 0 for d in dims)


def dsa_fast_path(x: torch.Tensor) -> bool:
    """The DSA Triton kernels (index scoring + top-k, sparse MLA) wherever the fast path runs;
    HYSERVE_DSA_TRITON=0 keeps the torch references on CUDA (to bisect a kernel against them)."""
    return fast_path(x) and os.environ.get("HYSERVE_DSA_TRITON", "1") != "0"


@contextlib.contextmanager
def reference_ops() -> Iterator[None]:
    """Run the torch reference ops inside this block, even on CUDA tensors."""
    global _forced_reference
    old, _forced_reference = _forced_reference, True
    try:
        yield
    finally:
        _forced_reference = old
