"""Where an engine step's host time goes: the step-cost rows (benchmarks/gpu_step_cost.py) run through the
engine users get (`LLM(...)`), each timed, then run again under three instruments, one at a time:

1. CUDA's sync debug mode: every operation that makes the host wait for the GPU, counted per step by the
   hyserve / fla frames that issued it (a sync inside a step drains the queue the async engine keeps full);
2. cProfile: the Python functions the host spends the step in (own time and cumulative);
3. torch.profiler: GPU kernel time per step beside the runtime calls (kernel launches, copies, syncs) and
   the aten operators with the most host time.

A step whose wall time is far above its GPU kernel time is bound by the host; this says by what.

    python benchmarks/gpu_step_host.py                                  # one H200, the 48B preset
    python benchmarks/gpu_step_host.py --rows 0:2048:0,32:2048:10240 --top 30
    python benchmarks/gpu_step_host.py --model k3-tiny --device cpu --rows 0:32:0 --steps 2   # dry run
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import io
import pstats
import sys
import time
import traceback
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_step_cost import Row, code_state, parse_rows  # noqa: E402

DEFAULT_ROWS = "0:2048:0,32:2048:10240,0:8192:0"


def sync_sites(row: Row, steps: int, cuda: bool) -> collections.Counter:
    """(message, innermost hyserve/fla frames) -> count of host syncs over `steps` steps (CUDA only)."""
    import torch

    sites: collections.Counter = collections.Counter()
    if not cuda:
        return sites

    def show(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack()[:-1] if "/hyserve/" in f.filename or "/fla/" in f.filename]
        where = " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in frames[-4:][::-1])
        sites[(str(message).split(".")[0][:50], where or "outside hyserve")] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            row.steps(steps)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return sites


def python_profile(row: Row, steps: int, sync, top: int) -> tuple[float, str]:
    """(ms per step under cProfile, the `top` functions by own time and by cumulative time)."""
    prof = cProfile.Profile()
    sync()
    t0 = time.perf_counter()
    prof.enable()
    row.steps(steps)
    prof.disable()
    sync()
    ms = (time.perf_counter() - t0) / steps * 1e3
    text = []
    for key in ("tottime", "cumtime"):
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(top)
        lines = buf.getvalue().splitlines()
        start = next((i for i, line in enumerate(lines) if line.lstrip().startswith("ncalls")), 0)
        text += [f"by {key} (seconds over {steps} steps):", *lines[start : start + top + 1]]
    return ms, "\n".join(text)


def torch_profile(row: Row, steps: int, sync, top: int, cuda: bool) -> tuple[float, dict, list[str]]:
    """(GPU kernel ms per step, runtime calls per step, the `top` aten ops by own host time)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync()
    with profile(activities=acts) as prof:
        row.steps(steps)
        sync()
    events = prof.key_averages()
    cuda_type = torch.autograd.DeviceType.CUDA
    gpu = sum(e.self_device_time_total for e in events if e.device_type == cuda_type) / steps / 1e3
    runtime = {e.key: round(e.count / steps, 1) for e in events
               if any(w in e.key for w in ("Launch", "Memcpy", "Synchronize")) or e.key == "aten::_local_scalar_dense"}
    ops = sorted((e for e in events if e.device_type != cuda_type and e.key.startswith("aten::")),
                 key=lambda e: -e.self_cpu_time_total)[:top]
    lines = [f"{e.key[:48]:48s} x{e.count / steps:6.0f}/step  host {e.self_cpu_time_total / steps / 1e3:7.2f} ms/step"
             for e in ops]
    return gpu, runtime, lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="kimi-linear-48b-a3b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--rows", default=DEFAULT_ROWS, help="B:P:C,... (decodes, prefill tokens, context)")
    p.add_argument("--steps", type=int, default=4, help="steps per instrument (and twice as many timed)")
    p.add_argument("--top", type=int, default=20, help="lines per profile table")
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=None,
                   help="the engine's start-up warm-up (default: the engine's; each row's untimed steps compile)")
    args = p.parse_args(argv)
    try:
        rows = parse_rows(args.rows)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import torch

    from hyserve import LLM

    cuda = args.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    need = max(c + q for _, q, c in rows) + 3 * args.steps + 32
    llm = LLM(args.model, device=args.device, max_model_len=need, max_num_seqs=max(b for b, _, _ in rows) + 4,
              max_num_batched_tokens=max(b + q for b, q, _ in rows) + 2, long_prefill_token_threshold=0,
              warmup=args.warmup)
    print(f"# Host time of engine steps, {args.model} on {args.device}; code state {code_state()}; "
          f"{time.strftime('%Y-%m-%d %H:%M')}", flush=True)
    for i, (b, q, c) in enumerate(rows):
        row = Row(llm, b, q, c, seed=2000 + i, steps=6 * args.steps + 4)
        row.steps(4)  # compiles and tunes (without the warm-up) and reaches the steady composition
        sync()
        t0 = time.perf_counter()
        row.steps(2 * args.steps)
        sync()
        wall = (time.perf_counter() - t0) / (2 * args.steps) * 1e3
        sites = sync_sites(row, args.steps, cuda)
        prof_ms, py = python_profile(row, args.steps, sync, args.top)
        gpu, runtime, ops = torch_profile(row, args.steps, sync, args.top, cuda)
        print(f"\n## row {b}:{q}:{c}: wall {wall:.2f} ms/step, GPU kernels {gpu:.2f} ms/step "
              f"({f'GPU idle {max(0.0, 1 - gpu / wall):.0%}' if cuda else 'no GPU'}), "
              f"{prof_ms:.2f} ms/step under cProfile")
        print(f"host syncs: {sum(sites.values()) / args.steps:.1f}/step" + ("" if cuda else " (CUDA only)"))
        for (msg, where), n in sites.most_common(args.top):
            print(f"  {n / args.steps:6.1f}/step  {msg} | {where}")
        print(f"runtime calls per step: {runtime}")
        print("aten operators by host time:", *ops, sep="\n  ")
        print(py, flush=True)
        row.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
