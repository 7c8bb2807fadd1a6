"""Named host phases of an engine step, for torch.profiler traces: `benchmarks/gpu_spec_decode.py
--profile-batch` prints each one's host time a step beside the step's GPU kernels. Outside a profiler a
phase costs one check (about 0.1 µs)."""

from __future__ import annotations

import contextlib
import functools

import torch

PREFIX = "hyserve::"


def phase(name: str) -> contextlib.AbstractContextManager:
    """A `record_function` range named PREFIX + name while a profiler records, else nothing."""
    if torch._C._autograd._profiler_enabled():
        return torch.profiler.record_function(PREFIX + name)
    return contextlib.nullcontext()


def phased(name: str):
    """Decorator: the function's calls are the phase `name`."""
    def wrap(fn):
        @functools.wraps(fn)
        def inner(*args, **kwargs):
            with phase(name):
                return fn(*args, **kwargs)
        return inner
    return wrap
