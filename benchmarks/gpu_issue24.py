"""Issue 24's start-up and prefill numbers in one device call of at most ten minutes, through the entry points
users run: `hyserve serve` (+ the bench client) and `LLM(...)`.

    python benchmarks/gpu_issue24.py                 # one H200; appends to docs/BENCHMARKS.md and $OUT
    python benchmarks/gpu_issue24.py --dry-run       # the CPU path: k3-tiny, small prompts, prints only

1. Start-up, without and with the warm-up: `hyserve serve MODEL --no-warmup` then `--warmup`, each with a
   Triton cache of its own that starts empty (what a first start on a machine pays): seconds until /health
   answers and the engine's phases ("load", "warm-up", "graph capture", ...). Against each server, in
   order: a first 1K prompt, three more (steady state), a first 8K prompt, three more; TTFT of each, the
   first against the median of the steady ones (target: within 1.5x), and the server's count of Triton kernel
   variants compiled after ready (/metrics; the server log names each, copied to $OUT).
2. Cold prefill TTFT (no prefix hit) at 8K and 32K on the warmed server (targets 200 ms and 1.0 s).
3. The step-cost table (benchmarks/gpu_step_cost.py) through `LLM(...)`, with the warmed server's cache.
Every prompt is random token ids no earlier request shares. Phases stop early, with a note, when the
--budget-s is nearly spent, so whatever was measured still comes back.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
_T0 = time.monotonic()


def say(msg: str) -> None:
    print(f"[gpu_issue24 {time.monotonic() - _T0:6.1f} s] {msg}", flush=True)


def left(args) -> float:
    return args.budget_s - (time.monotonic() - _T0)


def parse_ready(log_text: str) -> tuple[float | None, dict[str, float]]:
    """(seconds after process start, {phase: seconds}) from the server's "engine ready ... after process
    start (...)" line."""
    m = re.search(r"engine ready ([\d.]+) s after process start \(([^)]*)\)", log_text)
    if not m:
        return None, {}
    phases = {name.strip(): float(sec) for name, sec in re.findall(r"([a-z][a-z -]*?) ([\d.]+) s", m.group(2))}
    return float(m.group(1)), phases


async def ttft_ms(url: str, model: str, prompt: list[int]) -> float:
    import httpx

    from hyserve.bench.serve_client import EndpointConfig, send_request

    cfg = EndpointConfig(base_url=url, model=model, endpoint="completions", stream=True, ignore_eos=True,
                         prompt_format="ids", request_timeout_s=600.0)
    async with httpx.AsyncClient(timeout=600.0) as client:
        r = await send_request(client, cfg, prompt, 2)
    if not r.success:
        raise RuntimeError(f"request of {len(prompt)} tokens failed: {r.error}")
    return r.ttft * 1e3


def compiled_after_ready(url: str) -> int:
    """The server's `hyserve:kernels_compiled_after_ready` counter (planning/compile_watch.py)."""
    import httpx

    m = re.search(r"^hyserve:kernels_compiled_after_ready(?:_total)?(?:\{[^}]*\})? ([\d.e+]+)$",
                  httpx.get(url + "/metrics", timeout=30.0).text, re.M)
    return int(float(m.group(1))) if m else -1


class Prompts:
    """Random token ids, never repeated across calls (no prefix hit between any two)."""

    def __init__(self, seed: int, vocab: int):
        self.rng, self.vocab = random.Random(seed), vocab

    def __call__(self, n: int) -> list[int]:
        return [self.rng.randrange(min(1000, self.vocab // 4), self.vocab) for _ in range(n)]


def serve_run(args, warmup: bool, cache: Path, prompts: Prompts, cold_sizes: tuple[int, ...]) -> dict:
    from hyserve.bench.live import serve_subprocess

    flags = ["--max-model-len", str(args.max_model_len), "--warmup" if warmup else "--no-warmup", *args.serve_flag]
    log = cache / "server.log"
    env = {"HYSERVE_CACHE_ROOT": str(cache), "TRITON_CACHE_DIR": str(cache / "triton"),
           "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor")}
    out: dict = {"warmup": warmup}
    t0 = time.monotonic()
    with serve_subprocess(*flags, model=args.model, device=args.device, timeout=args.budget_s, env=env,
                          log_path=str(log)) as (url, _):
        out["healthy_s"] = time.monotonic() - t0
        out["ready_s"], out["phases"] = parse_ready(log.read_text())
        say(f"{'warm-up' if warmup else 'no warm-up'}: healthy after {out['healthy_s']:.1f} s {out['phases']}")
        for n in (args.small, args.large):
            first = asyncio.run(ttft_ms(url, args.model, prompts(n)))
            compiled = compiled_after_ready(url)  # cumulative: after the first 1K, then after the first 8K
            steady = [asyncio.run(ttft_ms(url, args.model, prompts(n))) for _ in range(args.repeats)]
            out[n] = (first, statistics.median(steady))
            out[("compiled", n)] = compiled
            say(f"  {n} tokens: first TTFT {first:.0f} ms, steady {out[n][1]:.0f} ms; "
                f"Triton variants compiled after ready so far: {compiled}")
        for n in cold_sizes:
            if left(args) < args.reserve_s:
                say(f"  cold prefill {n}: skipped, the budget is nearly spent")
                continue
            out[("cold", n)] = statistics.median(asyncio.run(ttft_ms(url, args.model, prompts(n))) for _ in range(2))
            say(f"  cold prefill {n}: TTFT {out[('cold', n)]:.0f} ms")
    missed = [line for line in log.read_text().splitlines() if "compiled a kernel after ready" in line]
    if missed and os.environ.get("OUT"):  # which kernels and shapes the warm-up missed
        Path(os.environ["OUT"], f"compiled_after_ready_{'warmup' if warmup else 'no_warmup'}.txt").write_text(
            "\n".join(missed) + "\n")
    return out


def startup_table(runs: list[dict], args) -> list[str]:
    rows = ["| server | healthy after | ready after (engine) | phases | first / steady TTFT, "
            f"{args.small} tokens | ratio | first / steady TTFT, {args.large} tokens | ratio | "
            "Triton variants compiled after ready (after the first of each) |",
            "|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        phases = ", ".join(f"{k} {v:.1f} s" for k, v in r["phases"].items()) or "n/a"
        cells = []
        for n in (args.small, args.large):
            first, steady = r.get(n, (None, None))
            cells += [f"{first:.0f} / {steady:.0f} ms", f"{first / steady:.2f}x"] if first else ["n/a", "n/a"]
        ready = f"{r['ready_s']:.1f} s" if r.get("ready_s") is not None else "n/a"
        cells.append(" / ".join(str(r.get(("compiled", n), "n/a")) for n in (args.small, args.large)))
        rows.append(f"| {'--warmup' if r['warmup'] else '--no-warmup'} | {r['healthy_s']:.1f} s | {ready} | {phases} | "
                    + " | ".join(cells) + " |")
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="kimi-linear-48b-a3b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--max-model-len", type=int, default=40960)
    p.add_argument("--small", type=int, default=1024)
    p.add_argument("--large", type=int, default=8192)
    p.add_argument("--cold", default="8192,32768", help="cold prefill prompt lengths")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rows", default=None, help="step-cost rows (default: gpu_step_cost.py's)")
    p.add_argument("--serve-flag", action="append", default=[], help="one more `hyserve serve` flag (repeatable)")
    p.add_argument("--parts", default="startup,steps", help="startup (1 and 2) and/or steps (3)")
    p.add_argument("--budget-s", type=float, default=570.0)
    p.add_argument("--reserve-s", type=float, default=150.0, help="left for the step-cost table")
    p.add_argument("--dry-run", action="store_true", help="k3-tiny on the CPU, small sizes; prints only")
    p.add_argument("--no-append", action="store_true")
    args = p.parse_args(argv)
    if args.dry_run:
        args.model, args.device, args.max_model_len, args.small, args.large, args.cold = "k3-tiny", "cpu", 1024, 64, 256, "256,512"
        args.rows, args.no_append = args.rows or "2:32:64,0:64:0", True
        args.serve_flag += ["--block-size", "16", "--max-num-batched-tokens", "128"]
    parts = set(args.parts.split(","))
    tables: list[str] = []
    notes: list[str] = []
    work = Path(tempfile.mkdtemp(prefix="gpu_issue24_"))
    warm_cache = work / "warm"
    if "startup" in parts:
        from hyserve.entrypoints.info import resolve_config

        prompts, runs = Prompts(24, resolve_config(args.model).vocab_size), []
        for warmup in (False, True):
            cache = work / ("warm" if warmup else "cold")
            cache.mkdir()
            cold = tuple(int(x) for x in args.cold.split(",")) if warmup else ()
            runs.append(serve_run(args, warmup, cache, prompts, cold))
        tables += startup_table(runs, args) + [""]
        cold = {k[1]: v for k, v in runs[-1].items() if isinstance(k, tuple) and k[0] == "cold"}
        tables += ["| cold prefill | " + " | ".join(f"{n} tokens" for n in cold) + " |",
                   "|---|" + "---|" * len(cold), "| TTFT (warmed server) | " + " | ".join(f"{v:.0f} ms" for v in cold.values()) + " |", ""]
        notes.append(f"Servers: `hyserve serve {args.model} --max-model-len {args.max_model_len} "
                     f"{' '.join(args.serve_flag)} [--no-warmup | --warmup]`, each with an empty Triton cache of its own; "
                     f"TTFT by `hyserve bench`'s client (streamed completions of token ids, 2 output tokens), "
                     f"steady = median of {args.repeats} more prompts of the same length, none sharing a prefix.")
    if "steps" in parts:
        if left(args) < 60:
            notes.append("The step-cost table was skipped: the budget was spent.")
        else:
            if warm_cache.exists():  # the kernels the warmed server compiled and tuned
                os.environ.update(HYSERVE_CACHE_ROOT=str(warm_cache), TRITON_CACHE_DIR=str(warm_cache / "triton"))
            from gpu_step_cost import DEFAULT_ROWS, step_cost_table

            ns = argparse.Namespace(model=args.model, device=args.device, rows=args.rows or DEFAULT_ROWS, steps=8,
                                    warmup_steps=3, profile=0, warmup=None)
            rows, step_notes = step_cost_table(ns)
            tables += rows + [""]
            notes += step_notes
    say("done")
    if args.no_append or args.device != "cuda":
        print("\n".join(tables + notes))
        return 0
    from gpu_common import report

    command = " ".join(["python benchmarks/gpu_issue24.py", *(sys.argv[1:] if argv is None else argv)])
    report(f"Issue 24: start-up, warm start, cold prefill and step cost, {args.model}", command, tables, notes,
           "gpu_issue24.md", date=time.strftime("%Y-%m-%d"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
