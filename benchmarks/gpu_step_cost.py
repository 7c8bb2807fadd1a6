"""The step-cost table: engine steps of B decodes beside P prefill tokens over contexts of C tokens, each
timed through the engine users get (`LLM(...)`: product loader, cache sizing, warm-up, graphs, async
scheduling) and set against its floor from the step cost model (hyserve/planning/step_cost.py).

    python benchmarks/gpu_step_cost.py                  # one H200: appends the table to docs/BENCHMARKS.md
    python benchmarks/gpu_step_cost.py --model k3-tiny --device cpu --rows 2:16:32,0:32:0 --no-append  # dry run
    python benchmarks/gpu_step_cost.py --rows 32:2048:10240,0:2048:0 --profile 12   # plus per-kernel breakdowns

A row B:P:C: a C-token context is computed once and cached (prefix caching); B requests that share it
and add one token of their own decode; then, before each step, one request of that context and P + 1 new
tokens arrives. The prefix cache ends its first chunk at its prompt-end checkpoint (P tokens) and its last
token rides in the next step, so every steady step holds the B decodes and P + 1 prompt tokens over the
cached C (the long-prefill cap is off, so nothing else splits the chunk). The first --warmup-steps steps are left out, the next
--steps are timed on the host as a client waits on them (synchronised at both ends), and each timed
step's composition is checked from the engine's `last_step` record. The floor uses the copy bandwidth and
matmul rate measured in the same run (on the CPU, the H200's nominal ceilings, so the dry run prints a
complete table). "Part by part" sums each part's own roofline (kernels that do not overlap each other).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# (decodes, prefill tokens, context): the mixed step at c = 32 (a 2,048-token chunk and 32 decodes
# over ~10K contexts), decode-only and prefill-only steps around it, and the step budget's 8,192 tokens
DEFAULT_ROWS = "1:0:1024,32:0:10240,64:0:1024,0:2048:0,0:8192:0,0:2048:10240,8:2048:10240,32:2048:10240,32:8192:10240,64:2048:1024"


def parse_rows(text: str) -> list[tuple[int, int, int]]:
    rows = []
    for item in text.split(","):
        try:
            b, p, c = (int(x) for x in item.split(":"))
        except ValueError:
            b = p = c = -1
        if b < 0 or p < 0 or c < 0 or b + p == 0:
            raise ValueError(f"bad row {item!r}: B:P:C with B + P > 0")
        rows.append((b, p, c))
    return rows


def _ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(1, vocab) for _ in range(n)]


def _drain(engine) -> None:
    while engine.has_unfinished_requests():
        engine.step()


class Row:
    """One B:P:C row's requests on an engine: a C-token context computed once and cached, B requests that
    share it and add one token of their own decoding together, and before every step of `steps` a fresh
    request of that context and P + 1 new tokens."""

    def __init__(self, llm, b: int, p: int, ctx: int, seed: int, steps: int):
        from hyserve import SamplingParams

        self.engine, self.p, self.seed, self.n = llm.engine, p, seed, 0
        self.vocab = self.engine.model_config.vocab_size
        self.rng = random.Random(seed)
        self.base = _ids(self.rng, ctx, self.vocab)
        self.one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        if ctx:
            self.engine.add_request(f"base{seed}", {"prompt_token_ids": self._prompt(1)}, self.one)
            _drain(self.engine)  # the context's pages and its checkpoint at ctx are cached
        long = SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True)
        for i in range(b):
            self.engine.add_request(f"d{seed}-{i}", {"prompt_token_ids": self._prompt(1)}, long)
        while b and not (self.engine.last_step and self.engine.last_step.num_decode_tokens == b):
            self.engine.step()  # until all b decode together

    def _prompt(self, new: int) -> list[int]:
        return self.base + _ids(self.rng, new, self.vocab)

    def steps(self, n: int) -> None:
        for _ in range(n):
            if self.p:
                self.engine.add_request(f"c{self.seed}-{self.n}", {"prompt_token_ids": self._prompt(self.p + 1)}, self.one)
                self.n += 1
            self.engine.step()

    def close(self) -> None:
        for rid in list(self.engine.parents):
            self.engine.abort_request(rid)
        _drain(self.engine)


def measure_row(llm, b: int, p: int, ctx: int, steps: int, warmup: int, seed: int, top: int = 0) -> dict:
    """Host ms per step of `b` decodes and a `p`-token chunk over a `ctx`-token cached context; `top` > 0:
    the timed steps run under torch.profiler and "kernels" holds the GPU ms per step and the largest kernels."""
    row = Row(llm, b, p, ctx, seed, steps + warmup)
    engine = row.engine
    row.steps(warmup)
    sync = _synchronizer(engine)
    ok = 0
    prof = _profiler(top, engine.device.type == "cuda")
    sync()
    prof.__enter__()
    t0 = time.perf_counter()
    for _ in range(steps):
        row.steps(1)
        last = engine.last_step
        if last is not None and last.num_decode_tokens >= b and last.num_prompt_tokens == p + (p > 0):
            ok += 1
    sync()
    timed = time.perf_counter() - t0
    prof.__exit__(None, None, None)
    row.close()
    return {"ms": timed / steps * 1e3, "steps": steps, "as_planned": ok,
            "kernels": _largest(prof, steps, top) if top else None}


def _profiler(top: int, cuda: bool):
    if not top:
        return contextlib.nullcontext()
    from torch.profiler import ProfilerActivity, profile

    return profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU])


def _largest(prof, steps: int, top: int) -> tuple[float, str]:
    """(kernel ms per step, the `top` largest kernels: name x calls per step, ms per step): GPU kernels on
    CUDA, operators' own CPU time in a CPU dry run."""
    import torch

    events = prof.key_averages()
    if any(e.device_type == torch.autograd.DeviceType.CUDA for e in events):
        timed = [(e, e.self_device_time_total) for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    else:
        timed = [(e, e.self_cpu_time_total) for e in events]
    total = sum(t for _, t in timed) / steps / 1e3
    largest = sorted(timed, key=lambda et: -et[1])[:top]
    return total, "; ".join(f"{e.key[:60]} x{e.count / steps:.0f} {t / steps / 1e3:.2f}" for e, t in largest)


def _synchronizer(engine):
    import torch

    if engine.device.type == "cuda":
        return lambda: torch.cuda.synchronize(engine.device)
    return lambda: None


def code_state() -> str:
    """The commit the benchmark runs (and whether the tree differs from it). HYSERVE_CODE_STATE overrides
    it where the checkout's git state is not the code's (a device's copy of a working tree)."""
    if os.environ.get("HYSERVE_CODE_STATE"):
        return os.environ["HYSERVE_CODE_STATE"]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                               text=True).stdout.strip()
        return head + (" (with uncommitted changes)" if dirty else "")
    except OSError:
        return "unknown"


def step_cost_table(args) -> tuple[list[str], list[str]]:
    """(markdown rows, notes) of every row of `args.rows`."""
    from hyserve import LLM
    from hyserve.planning.ceilings import H200, DeviceCeilings
    from hyserve.planning.step_cost import StepCostModel, StepShape

    rows = parse_rows(args.rows)
    cuda = args.device == "cuda"
    if cuda:
        from gpu_common import ceilings

        measured = ceilings()
        ceil = DeviceCeilings("this run", measured["copy_tbs"] * 1e12, measured["mm_tflops"] * 1e12, measured=True)
    else:
        ceil = H200
    need = max(c + p for _, p, c in rows) + args.steps + args.warmup_steps + 16
    # room beside the B decodes for three chunk requests: under async scheduling a finished one holds its
    # state slot one step longer, while the next two are in flight (B + 2 planned 2 of 8 steps at B = 64)
    llm = LLM(args.model, device=args.device, max_model_len=need, max_num_seqs=max(b for b, _, _ in rows) + 4,
              max_num_batched_tokens=max(b + p for b, p, _ in rows) + 2, long_prefill_token_threshold=0,
              warmup=args.warmup)
    engine = llm.engine
    weight_bytes = engine.model.dtype.itemsize
    costs = StepCostModel(engine.model_config, weight_bytes, engine.kv.tensors.pages.element_size())
    table = ["| decodes B | prefill P | context | ms/step | steps as planned | weights read | TFLOP | floor | "
             "floor/time | part by part | part by part/time |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    profiled = ["| decodes B | prefill P | context | ms/step (profiled) | GPU kernel ms/step | largest kernels: "
                "name x calls/step ms/step |", "|---|---|---|---|---|---|"]
    for i, (b, p, c) in enumerate(rows):
        m = measure_row(llm, b, p, c, args.steps, args.warmup_steps, seed=1000 + i, top=args.profile)
        cost = costs.cost(StepShape(decodes=b, decode_context=c + 1 + args.warmup_steps + args.steps // 2,
                                    prefill=p + (p > 0), prefill_context=c))
        floor, seq = cost.floor_s(ceil) * 1e3, cost.sequential_floor_s(ceil) * 1e3
        table.append(f"| {b} | {p} | {c} | {m['ms']:.2f} | {m['as_planned']}/{m['steps']} | "
                     f"{cost.weight_bytes / 1e9:.3g} GB | {cost.flops / 1e12:.3g} | {floor:.3g} ms | "
                     f"{floor / m['ms']:.0%} | {seq:.3g} ms | {seq / m['ms']:.0%} |")
        print(table[-1], flush=True)
        if m["kernels"]:
            profiled.append(f"| {b} | {p} | {c} | {m['ms']:.2f} | {m['kernels'][0]:.2f} | {m['kernels'][1]} |")
            print(profiled[-1], flush=True)
    if args.profile:  # the profiler's host cost is in these rows' times: the table above is the timing
        table += ["", "Per-kernel breakdown (torch.profiler over the timed steps):", "", *profiled]
    cfg = engine.cfg
    notes = [f"Model {args.model}, {engine.model.dtype}; engine as built by `LLM(...)`: async scheduling "
             f"{cfg.async_scheduling}, CUDA graphs {not cfg.enforce_eager}, warm-up {cfg.warmup}, prefix caching on; "
             f"max_num_batched_tokens {cfg.max_num_batched_tokens}, long-prefill cap off. Ceilings: {ceil.describe()}"
             + ("" if cuda else "; nominal, for a CPU dry run") + ".",
             f"{args.warmup_steps} untimed steps, then {args.steps} timed per row; 'steps as planned' counts the timed "
             "steps whose `last_step` held the B decodes and P + 1 prompt tokens. Triton kernel variants compiled after "
             f"ready over all rows: {engine.stats.kernels_compiled_after_ready}. Code state: " + code_state() + "."]
    return table, notes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="kimi-linear-48b-a3b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--rows", default=DEFAULT_ROWS, help="B:P:C,... (decodes, prefill tokens, context)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup-steps", type=int, default=3)
    p.add_argument("--profile", type=int, default=0, metavar="TOP",
                   help="also profile each row's timed steps and list its TOP largest kernels")
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=None,
                   help="the engine's start-up warm-up (default: the engine's; each row's untimed steps compile)")
    p.add_argument("--no-append", action="store_true", help="print only; leave docs/BENCHMARKS.md alone")
    args = p.parse_args(argv)
    try:
        parse_rows(args.rows)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    table, notes = step_cost_table(args)
    if args.no_append or args.device != "cuda":
        print("\n".join(table + [""] + notes))
        return 0
    from gpu_common import report

    command = " ".join(["python benchmarks/gpu_step_cost.py", *(sys.argv[1:] if argv is None else argv)])
    report(f"Step cost against the floor, {args.model}", command, table, notes, "gpu_step_cost.md",
           date=time.strftime("%Y-%m-%d"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
