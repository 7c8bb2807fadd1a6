"""Where a decode step's GPU time goes: torch.profiler over decode-only engine steps of the
kimi-linear-48b-a3b preset (random bf16 weights), eager and with CUDA graphs, at each batch size. Each
(batch, mode) runs in its own engine as `LLM(...)` builds it (product loader, cache, graphs).

    python benchmarks/gpu_decode_profile.py                 # one H200; appends to docs/BENCHMARKS.md
    python benchmarks/gpu_decode_profile.py --batches 1 --no-append
    python benchmarks/gpu_decode_profile.py --batches 64 --trace /tmp/traces   # plus Chrome traces

Modes: eager, graphs (CUDA graphs), async (graphs + async scheduling). Prints, per (batch, mode), the host
time per profiled step, the summed GPU kernel time per step and the
largest kernels by GPU time: the per-kernel breakdown behind benchmarks/gpu_engine_decode.py's numbers.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

import torch
from gpu_common import MODEL_48B
from torch.profiler import ProfilerActivity, profile

from hyserve import LLM, SamplingParams

PROMPT, STEPS = 512, 10


def profile_steps(n: int, mode: str, top: int, trace: str | None = None) -> str:
    llm = LLM(MODEL_48B, device="cuda", max_num_seqs=max(n, 1), max_model_len=1024, enforce_eager=mode == "eager",
              enable_prefix_caching=False, async_scheduling=mode == "async")
    engine = llm.engine
    gen = torch.Generator().manual_seed(n)
    for i in range(n):
        engine.add_request(str(i), torch.randint(0, 1000, (PROMPT,), generator=gen).tolist(),
                           SamplingParams(temperature=0.0, max_tokens=STEPS + 50, ignore_eos=True))
    for _ in range(n * PROMPT // 2048 + 6):  # the prefill steps, then a few decodes
        engine.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        for _ in range(STEPS):
            engine.step()
        torch.cuda.synchronize()
        host = (time.perf_counter() - t) / STEPS * 1e3
    if trace:  # the timeline shows where the GPU sits idle between a step's kernels and the next step's
        os.makedirs(trace, exist_ok=True)
        prof.export_chrome_trace(os.path.join(trace, f"decode_b{n}_{mode}.json"))
    while engine.has_unfinished_requests():
        engine.step()
    del engine, llm  # the LLM holds the engine, and with it the weights and the cache pool
    gc.collect()
    torch.cuda.empty_cache()
    kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    gpu = sum(e.self_device_time_total for e in kernels) / STEPS / 1e3
    largest = sorted(kernels, key=lambda e: -e.self_device_time_total)[:top]
    names = "; ".join(f"{e.key[:48]} x{e.count // STEPS} {e.self_device_time_total / STEPS / 1e3:.2f}" for e in largest)
    return f"| {n} | {mode} | {host:.2f} | {gpu:.2f} | {names} |"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", default="1,64")
    p.add_argument("--modes", default="eager,graphs", help="of eager, graphs, async (graphs + async scheduling)")
    p.add_argument("--top", type=int, default=8, help="kernels listed per row")
    p.add_argument("--trace", default=None, help="directory for a Chrome trace of each profiled run")
    p.add_argument("--no-append", action="store_true", help="print only; leave docs/BENCHMARKS.md alone")
    args = p.parse_args(argv)
    table = ["| batch | mode | host ms/step (profiled) | GPU kernel ms/step | largest kernels: name x calls/step ms/step |",
             "|---|---|---|---|---|"]
    for n in (int(b) for b in args.batches.split(",")):
        for mode in args.modes.split(","):
            table.append(profile_steps(n, mode, args.top, args.trace))
            print(table[-1], flush=True)
    notes = [f"{STEPS} decode-only steps after {PROMPT}-token prompts, prefix caching off; the profiler adds host time."]
    if args.no_append:
        print("\n".join(table + [""] + notes))
        return
    from gpu_common import report

    command = " ".join(["python benchmarks/gpu_decode_profile.py", *(sys.argv[1:] if argv is None else argv)])
    report("Decode step profile, kimi-linear-48b-a3b", command, table, notes, "gpu_decode_profile.md")


if __name__ == "__main__":
    main()
