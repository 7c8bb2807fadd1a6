"""The engine's named host phases (hyserve/engine/phases.py): nothing outside a profiler, and every phase
of a speculative step in a torch.profiler trace (benchmarks/gpu_spec_decode.py --profile-batch reads
them)."""

from __future__ import annotations

import contextlib

from test_spec_engine import repetitive_prompts, run
from torch.profiler import ProfilerActivity, profile

from hyserve.engine.phases import PREFIX, phase, timed


def test_a_phase_outside_a_profiler_records_nothing():
    assert isinstance(phase("schedule"), contextlib.nullcontext)


def test_a_profiled_speculative_step_records_each_host_phase(make_llm):
    spec = {"method": "ngram", "num_speculative_tokens": 3, "rejection_sample_method": "synthetic",
            "synthetic_acceptance_length": 3.0}
    llm = make_llm(enable_prefix_caching=False, speculative_config=spec)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run(llm, repetitive_prompts(2, seed=3))
    names = {e.key[len(PREFIX):] for e in prof.key_averages() if e.key.startswith(PREFIX)}
    assert names == {"schedule", "step_inputs", "forward_launch", "sample", "readback", "land", "propose", "outputs"}


def test_timed_clocks_each_phase_of_a_speculative_run_and_stops_after(make_llm):
    spec = {"method": "ngram", "num_speculative_tokens": 3, "rejection_sample_method": "synthetic",
            "synthetic_acceptance_length": 3.0}
    llm = make_llm(enable_prefix_caching=False, speculative_config=spec)
    with timed() as clock:
        run(llm, repetitive_prompts(2, seed=3))
    assert set(clock) == {"schedule", "step_inputs", "forward_launch", "sample", "readback", "land", "propose", "outputs"}
    assert all(seconds > 0 and calls >= 1 for seconds, calls in clock.values())
    assert clock["propose"][1] == clock["land"][1]  # every landing proposes
    assert isinstance(phase("schedule"), contextlib.nullcontext)
