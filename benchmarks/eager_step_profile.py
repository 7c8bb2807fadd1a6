"""Eager batch-1 decode steps of the 48B shape: wall time, host profile and the device work per step, so
two trees can be compared by what they launch and not only by a wall time that the host's load moves.

    python benchmarks/eager_step_profile.py new                  # this tree, engine built by LLM(...)
    (cd OLD_TREE && python ../benchmarks/eager_step_profile.py old)   # f375bbe, issue 23's "old main"

`old` builds the engine as f375bbe's own benchmarks did (its `gpu_common.load_48b` and `LLMEngine`:
f375bbe's loader could not build the 48B shape on one GPU); `new` through `LLM(...)`. One request of a
256-token prompt: 12 untimed steps, 4 timed passes of 24 `engine.step()` calls, a cProfile of 24 steps
(Python calls per step), then torch.profiler over 16 steps (kernel launches, host ops; the GPU busy time
is the tables' "Self CUDA time total").
Prints only; issue 23's record in docs/BENCHMARKS.md was made with it (CUDA only).
"""

from __future__ import annotations

import cProfile
import io
import pstats
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from hyserve import SamplingParams

MODEL = "kimi-linear-48b-a3b"
COUNTED = ("cuLaunchKernelEx", "cudaLaunchKernel", "aten::empty", "aten::mm", "aten::bmm", "aten::copy_",
           "cudaMemcpyAsync", "aten::_pin_memory")


def engine(side: str):
    if side == "old":
        sys.path.insert(0, "benchmarks")
        from gpu_common import load_48b  # the old tree's own helper

        from hyserve.config import EngineConfig
        from hyserve.engine.llm_engine import LLMEngine
        from hyserve.tokenizer import load_tokenizer

        model = load_48b()
        cfg = EngineConfig(model=MODEL, device="cuda", max_num_seqs=1, max_model_len=640, enforce_eager=True,
                           enable_prefix_caching=False, async_scheduling=False)
        return LLMEngine(cfg, model=model, tokenizer=load_tokenizer(None, model.config.tokenizer_family),
                         cuda_graphs=False)
    from hyserve import LLM

    return LLM(MODEL, device="cuda", max_num_seqs=1, max_model_len=640, enforce_eager=True,
               enable_prefix_caching=False, async_scheduling=False, warmup=False).engine


def main(side: str) -> None:
    eng = engine(side)
    eng.add_request("x", [10 + i % 400 for i in range(256)], SamplingParams(temperature=0.0, max_tokens=300,
                                                                            ignore_eos=True))
    for _ in range(12):  # the prefill and the first decodes compile
        eng.step()
    torch.cuda.synchronize()
    ms = []
    for _ in range(4):
        t = time.perf_counter()
        for _ in range(24):
            eng.step()
        torch.cuda.synchronize()
        ms.append((time.perf_counter() - t) / 24 * 1e3)
    print(f"RESULT {side} step ms (24 steps x 4): " + " ".join(f"{m:.2f}" for m in ms), flush=True)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(24):
        eng.step()
    prof.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("tottime").print_stats(40)
    print(f"RESULT {side} cProfile calls/step {stats.total_calls / 24:.0f}")
    print(text.getvalue()[:9000])
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as tprof:
        for _ in range(16):
            eng.step()
        torch.cuda.synchronize()
    events = tprof.key_averages()
    counts = {e.key: e.count for e in events if e.key in COUNTED}
    print(f"RESULT {side} calls in 16 steps: " + ", ".join(f"{k} {counts.get(k, 0)}" for k in COUNTED))
    print(events.table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=60))
    print(events.table(sort_by="self_device_time_total", row_limit=25, max_name_column_width=60))


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in ("old", "new"):
        sys.exit("usage: eager_step_profile.py old|new")
    main(sys.argv[1])
