"""Triton compilations after "ready" (hyserve/planning/compile_watch.py): counted apart from the start's own,
logged with the kernel they built, and on the server's /metrics. The watch is called here the way Triton's
post-compile hook calls it (keyword arguments only); on the GPU the hook is Triton's own."""

from __future__ import annotations

import logging

from hyserve.planning.compile_watch import CompileWatch, watch


def compile_event(w: CompileWatch, name: str = "rms_norm_kernel[num_warps=4](X: *bf16, N: i32)") -> None:
    w(key=("k", name), repr=name, fn=None, compile={}, is_manual_warmup=False, already_compiled=False)


def test_compilations_while_an_engine_starts_are_not_counted_as_after_ready():
    w = CompileWatch()
    compile_event(w)  # before any engine is ready: an import-time or first-engine compile
    with w.starting():
        compile_event(w)
    assert (w.before_ready, w.after_ready) == (2, 0)


def test_a_compilation_after_ready_is_counted_and_logged_with_the_kernel(caplog):
    w = CompileWatch()
    with w.starting():
        pass
    with caplog.at_level(logging.WARNING, logger="hyserve.planning.compile_watch"):
        compile_event(w, "chunk_kda_fwd_kernel[num_warps=8](T: i32)")
    assert w.after_ready == 1
    assert "chunk_kda_fwd_kernel[num_warps=8](T: i32)" in caplog.text


def test_a_second_engine_starting_in_the_process_does_not_count_its_own_compiles():
    w = CompileWatch()
    with w.starting():
        pass
    with w.starting():  # e.g. a benchmark building one LLM after another
        compile_event(w)
    assert w.after_ready == 0


def test_a_hook_installed_before_the_watch_is_still_called():
    seen = []
    w = CompileWatch()
    w._chained = lambda **kw: seen.append(kw["repr"])
    compile_event(w, "kernel_a")
    assert seen == ["kernel_a"]


def test_the_process_watch_is_triton_s_post_compile_hook():
    import pytest

    knobs = pytest.importorskip("triton").knobs
    w = watch()
    assert knobs.runtime.jit_post_compile_hook is w


def test_the_engine_reports_compilations_after_its_ready(make_engine):
    from hyserve import SamplingParams

    engine = make_engine()
    compile_event(watch())  # as a first request's new shape would
    engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=1))
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.stats.kernels_compiled_after_ready == 1
