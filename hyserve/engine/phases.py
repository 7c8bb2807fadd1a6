"""Named host phases of an engine step, for torch.profiler traces: `benchmarks/gpu_spec_decode.py
--profile-batch` prints each one's host time a step beside the step's GPU kernels. Inside `timed()` the
phases are clocked without a profiler (whose per-op recording inflates host time several-fold). Outside
both a phase costs one check (about 0.1 µs)."""

from __future__ import annotations

import contextlib
import functools
import time

import torch

PREFIX = "hyserve::"
_clock: dict[str, list[float]] | None = None  # name -> [seconds, calls] while `timed()` is active


def phase(name: str) -> contextlib.AbstractContextManager:
    """A `record_function` range named PREFIX + name while a profiler records, a perf_counter interval
    inside `timed()`, else nothing."""
    if torch._C._autograd._profiler_enabled():
        return torch.profiler.record_function(PREFIX + name)
    if _clock is not None:
        return _clocked(_clock, name)
    return contextlib.nullcontext()


@contextlib.contextmanager
def _clocked(clock: dict[str, list[float]], name: str):
    t0 = time.perf_counter()
    try:
        yield
    finally:
        entry = clock.setdefault(name, [0.0, 0])
        entry[0] += time.perf_counter() - t0
        entry[1] += 1


@contextlib.contextmanager
def timed():
    """Clock every phase entered inside: yields {name: [seconds, calls]} (nested phases count in both)."""
    global _clock
    outer, _clock = _clock, {}
    try:
        yield _clock
    finally:
        _clock = outer


def phased(name: str):
    """Decorator: the function's calls are the phase `name`."""
    def wrap(fn):
        @functools.wraps(fn)
        def inner(*args, **kwargs):
            with phase(name):
                return fn(*args, **kwargs)
        return inner
    return wrap
