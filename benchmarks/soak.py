"""Soak: 10,000 mixed requests against one `hyserve serve` (k3-tiny on the CPU by default), then the checks
of tests/test_soak.py at scale: every answer followed its kind's rule, the server went back to idle (no
request running or waiting, every pool gauge at its idle value), a fixed greedy request answers exactly
as before the soak, and the resident memory of the server and engine processes stayed bounded.

The mix (hyserve/bench/soak.py): full streams (n 1-3), chat streams (n 1-2), streams dropped at a random
point, requests whose client hangs up at once, non-streaming requests abandoned while running, n > 1,
structured outputs, prompts over the context length and bad requests. Prints a summary and appends it
to docs/BENCHMARKS.md (code state included) unless --no-append.

    python benchmarks/soak.py                      # 10,000 requests, 8 at a time
    python benchmarks/soak.py --url http://HOST:PORT --requests 2000   # a server already running
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import platform
import shlex
import subprocess
import sys
import time
from contextlib import nullcontext
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's hyserve, not an installed one

from results_doc import add_section

from hyserve.bench.live import ROOT, engine_pid, serve_subprocess
from hyserve.bench.soak import probe, rss_bytes, run_soak, wait_idle


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=10_000)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--url", default=None, help="soak this server instead of starting k3-tiny (no RSS figures)")
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--results-file", default=os.path.join(ROOT, "docs", "BENCHMARKS.md"))
    p.add_argument("--no-append", action="store_true", help="print only; leave the results file alone")
    return p.parse_args(argv)


def _code_state() -> str:
    head = subprocess.run(["git", "-C", str(ROOT), "log", "-1", "--format=%h %s"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    return f"`{head.stdout.strip()[:90]}`" + (" plus uncommitted changes" if dirty else "")


def soak(args: argparse.Namespace) -> dict:
    code = _code_state()  # the code the server starts with, before anything can change under it
    own = args.url is None
    flags = ("--max-model-len", str(args.max_model_len), "--max-num-seqs", "16")
    with serve_subprocess(*flags) if own else nullcontext((args.url, None)) as (url, proc):
        pids = {"server": proc.pid, "engine": engine_pid(proc)} if own else {}
        asyncio.run(run_soak(url, 50, seed=args.seed + 1, max_model_len=args.max_model_len))  # warm-up
        warm_leaks = wait_idle(url)
        answer = probe(url)
        before = {k: rss_bytes(p) for k, p in pids.items()}
        step = max(1, args.requests // 20)

        def progress(done: int) -> None:
            if done % step == 0:
                print(f"  {done}/{args.requests} requests, {time.monotonic() - t0:.0f} s", flush=True)

        t0 = time.monotonic()
        result = asyncio.run(run_soak(url, args.requests, concurrency=args.concurrency, seed=args.seed,
                                      max_model_len=args.max_model_len, progress=progress))
        wall = time.monotonic() - t0
        leaks = wait_idle(url, timeout=60)
        same = probe(url) == answer
        after = {k: rss_bytes(p) for k, p in pids.items()}
    return {"result": result, "wall": wall, "warm_leaks": warm_leaks, "leaks": leaks, "same": same,
            "before": before, "after": after, "code": code}


def summary(args: argparse.Namespace, r: dict) -> str:
    res = r["result"]
    kinds = ", ".join(f"{k} {v}" for k, v in sorted(res.counts.items()))
    rss = "; ".join(f"{k} {r['before'][k] / 2**20:.0f} -> {r['after'][k] / 2**20:.0f} MiB "
                    f"({(r['after'][k] - r['before'][k]) / 2**20:+.0f})" for k in r["before"]) or "not measured (--url)"
    ok = not res.problems and not r["leaks"] and not r["warm_leaks"] and r["same"]
    lines = [
        f"- requests: {sum(res.counts.values())} in {r['wall']:.0f} s ({sum(res.counts.values()) / r['wall']:.1f}/s), "
        f"{args.concurrency} at a time: {kinds}",
        f"- answers breaking their kind's rule: {len(res.problems)}" + (f" (first: {res.problems[0]})" if res.problems else ""),
        f"- idle afterwards (nothing running or waiting, pool gauges at idle): "
        f"{'yes' if not r['leaks'] else 'NO: ' + '; '.join(r['leaks'])}",
        f"- fixed greedy probe answers as before the soak: {'yes' if r['same'] else 'NO'}",
        f"- resident memory after warm-up -> after the soak: {rss}",
        f"- result: {'PASS' if ok else 'FAIL'}",
    ]
    return "\n".join(lines)


def section(args: argparse.Namespace, r: dict, command: str) -> str:
    when = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    machine = f"{platform.platform()}, {platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    machine += ", load average {:.1f} / {:.1f} / {:.1f} at the end".format(*os.getloadavg())
    target = args.url or f"k3-tiny on the CPU, --max-model-len {args.max_model_len} --max-num-seqs 16"
    return (f"\n## Soak: {args.requests} mixed requests against one server ({when})\n\n"
            f"- machine: {machine}\n- server: {target}\n- command: `{command}`\n- code: {r['code']}\n"
            f"{summary(args, r)}\n")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = "python " + shlex.join([os.path.relpath(__file__, ROOT), *(sys.argv[1:] if argv is None else argv)])
    r = soak(args)
    print(summary(args, r))
    if not args.no_append:
        add_section(args.results_file, section(args, r, command))
        print(f"recorded in {os.path.relpath(args.results_file, ROOT)}")
    return 0 if "PASS" in summary(args, r) else 1


if __name__ == "__main__":
    sys.exit(main())
