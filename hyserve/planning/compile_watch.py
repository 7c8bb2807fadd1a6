"""Triton compilations after "ready": the warm start's promise made observable. Every kernel variant
Triton builds in this process (a new specialization of a kernel's integer and pointer arguments, or one
config an autotuner tries) passes Triton's post-compile hook; once the engine is ready each one means a
request waited for a compiler, so it is counted (`hyserve:kernels_compiled_after_ready` on /metrics) and
logged with the kernel and its argument specialization, which names the shape the warm-up missed.

One watch per process: Triton's hook is process-wide. A hook installed before ours is still called. The
ranks of a parallel layout compile in their own processes, which this count does not see.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

log = logging.getLogger(__name__)
LOGGED = 20  # then every hundredth: an autotuner compiles one variant per config


class CompileWatch:
    """Counts compilations; those while an engine starts (`starting()`) are its warm-up's and capture's,
    those after an engine is ready and none is starting are what requests waited for."""

    def __init__(self) -> None:
        self.before_ready = 0
        self.after_ready = 0
        self._starting = 0
        self._ready = False
        self._chained = None

    def __call__(self, **hook_kwargs):
        # Triton's keywords (key, repr, fn, compile, is_manual_warmup, already_compiled) are passed on as
        # they come, so a release that adds one does not break compilation
        if self._starting or not self._ready:
            self.before_ready += 1
        else:
            self.after_ready += 1
            if self.after_ready <= LOGGED or self.after_ready % 100 == 0:
                fn = hook_kwargs.get("fn")
                log.warning("Triton compiled a kernel after ready (%d so far; the warm-up missed this shape): %s",
                            self.after_ready, hook_kwargs.get("repr") or getattr(fn, "name", fn))
        if self._chained is not None:
            return self._chained(**hook_kwargs)
        return None

    @contextlib.contextmanager
    def starting(self) -> Iterator[None]:
        """An engine's start: compilations inside are before its ready; at the end it is ready."""
        self._starting += 1
        try:
            yield
        finally:
            self._starting -= 1
        self._ready = True
        log.info("Triton kernel variants compiled in this process before ready: %d", self.before_ready)


_WATCH: CompileWatch | None = None


def watch() -> CompileWatch:
    """The process's watch, hooked into Triton on first use (where Triton has the hook: 3.4 and later)."""
    global _WATCH
    if _WATCH is None:
        _WATCH = CompileWatch()
        try:
            from triton import knobs
        except ImportError:  # no Triton (a CPU install) or one without knobs: nothing compiles to watch
            return _WATCH
        _WATCH._chained = knobs.runtime.jit_post_compile_hook
        knobs.runtime.jit_post_compile_hook = _WATCH
    return _WATCH
