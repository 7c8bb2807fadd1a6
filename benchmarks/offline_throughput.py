"""Offline throughput: batched `LLM.generate` against a one-at-a-time loop over the same requests.

Random token prompts (lengths uniform in [--min-prompt, --max-prompt]), fixed output length, ignore_eos.
Per-phase rates time each engine step of the batched pass, classified by the engine's `last_step` record
(what the step a call read back computed): a step that computes any prompt token is a prefill step
(prompt tok/s = prompt tokens / time of those steps; decodes riding along are not counted), a step of
decodes only is a decode step (decode tok/s = its tokens / its time). Prints a table and appends it to
docs/BENCHMARKS.md.

    python benchmarks/offline_throughput.py            # 64 requests on k3-tiny, 2 torch threads
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import random
import shlex
import sys
import time
from dataclasses import dataclass

import torch
from results_doc import add_section

from hyserve import LLM, SamplingParams
from hyserve.config import EngineConfig
from hyserve.engine.llm_engine import LLMEngine
from hyserve.models.loader import load_model
from hyserve.tokenizer import load_tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class Pass:
    seconds: float
    prompt_tokens: int
    output_tokens: int

    @property
    def total_tps(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.seconds

    @property
    def output_tps(self) -> float:
        return self.output_tokens / self.seconds


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="k3-tiny")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--min-prompt", type=int, default=16)
    p.add_argument("--max-prompt", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads (CI runners have 2 cores)")
    p.add_argument("--device", default=None)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--results-file", default=os.path.join(REPO, "docs", "BENCHMARKS.md"))
    p.add_argument("--no-append", action="store_true", help="print only; leave the results file alone")
    return p.parse_args(argv)


def make_llm(args, model, tokenizer) -> LLM:
    """A fresh engine (empty cache, so no prefix hits) around the already loaded weights."""
    cfg = EngineConfig(
        model=args.model, device=args.device, block_size=args.block_size, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    return LLM.from_engine(LLMEngine(cfg, model=model, tokenizer=tokenizer))


@dataclass
class Phases:
    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_tokens: int = 0
    decode_seconds: float = 0.0


def timed_loop(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> Pass:
    t0 = time.perf_counter()
    outs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
    return _pass(time.perf_counter() - t0, prompts, outs)


def timed_batch(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[Pass, Phases]:
    """What `LLM.generate` does, with each step timed and classified by what it computed (the engine's
    `last_step`: the step whose results the call read back; under async scheduling the call launches
    the next step too). A call that read none back is launch work of a prefill."""
    engine, phases = llm.engine, Phases()
    output_tokens = finished = 0
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        deltas = engine.step_deltas()  # what each request gained: accumulate only the counts needed here
        dt = time.perf_counter() - t
        for d in deltas:
            if d.error:
                raise RuntimeError(f"request {d.request_id} failed: {d.error}")
            output_tokens += sum(len(c.token_ids) for c in d.completions)
            finished += d.finished
        step = engine.last_step
        if step is None or step.num_prompt_tokens:
            phases.prefill_tokens += step.num_prompt_tokens if step is not None else 0
            phases.prefill_seconds += dt
        else:
            phases.decode_tokens += step.num_decode_tokens
            phases.decode_seconds += dt
    assert finished == len(prompts)
    return Pass(time.perf_counter() - t0, sum(len(p) for p in prompts), output_tokens), phases


def _pass(seconds: float, prompts: list[list[int]], outs) -> Pass:
    errors = [o.error for o in outs if o.error]
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed, e.g. {errors[0]}")
    return Pass(seconds, sum(len(p) for p in prompts), sum(len(o.outputs[0].token_ids) for o in outs))


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = load_model(args.model, device=device)
    tokenizer = load_tokenizer(None, model.config.tokenizer_family)
    rng = random.Random(args.seed)
    prompts = [
        [rng.randrange(256) for _ in range(rng.randint(args.min_prompt, args.max_prompt))]
        for _ in range(args.num_requests)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    timed_batch(make_llm(args, model, tokenizer), prompts[:2], params)  # warm-up: first-call allocations
    batched, phases = timed_batch(make_llm(args, model, tokenizer), prompts, params)
    loop = timed_loop(make_llm(args, model, tokenizer), prompts, params)
    return {
        "prefill_tps": phases.prefill_tokens / phases.prefill_seconds,
        "decode_tps": phases.decode_tokens / phases.decode_seconds,
        "phases": phases, "batched": batched, "loop": loop, "device": device,
    }


def table(r: dict) -> str:
    b, lp = r["batched"], r["loop"]
    rows = [
        ("wall time (s)", f"{b.seconds:.2f}", f"{lp.seconds:.2f}", f"{lp.seconds / b.seconds:.1f}x"),
        ("output tok/s", f"{b.output_tps:.1f}", f"{lp.output_tps:.1f}", f"{b.output_tps / lp.output_tps:.1f}x"),
        ("total tok/s (prompt + output)", f"{b.total_tps:.1f}", f"{lp.total_tps:.1f}",
         f"{b.total_tps / lp.total_tps:.1f}x"),
    ]
    lines = ["| metric | batched generate | one-at-a-time loop | ratio |", "|---|---:|---:|---:|"]
    lines += [f"| {a} | {x} | {y} | {z} |" for a, x, y, z in rows]
    lines += [
        "",
        f"Batched phases (per-step timing; a step with any prompt token counts as prefill): prefill "
        f"{r['prefill_tps']:.1f} prompt tok/s over {r['phases'].prefill_seconds:.2f} s, decode "
        f"{r['decode_tps']:.1f} output tok/s over {r['phases'].decode_seconds:.2f} s.",
    ]
    return "\n".join(lines)


def section(args: argparse.Namespace, r: dict, command: str) -> str:
    b = r["batched"]
    when = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    machine = f"{platform.platform()}, {platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    # a shared box's other work inflates both columns' times; the load says how busy it was
    machine += ", load average {:.1f} / {:.1f} / {:.1f} at the end".format(*os.getloadavg())
    if r["device"] == "cuda":
        machine += f", {torch.cuda.get_device_name()}"
    return (
        f"\n## Offline throughput: {args.model}, {args.num_requests} requests ({when})\n\n"
        f"- machine: {machine}; torch {torch.__version__}, {args.threads} intra-op threads, device {r['device']}\n"
        f"- command: `{command}`\n"
        f"- workload: prompts {args.min_prompt}-{args.max_prompt} random tokens ({b.prompt_tokens} in all), "
        f"{args.output_len} output tokens each, ignore_eos, greedy; block size {args.block_size}, "
        f"max_num_seqs {args.max_num_seqs}, max_num_batched_tokens {args.max_num_batched_tokens}\n\n"
        f"{table(r)}\n"
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = "python " + shlex.join([os.path.relpath(__file__, REPO), *(sys.argv[1:] if argv is None else argv)])
    r = run(args)
    print(table(r))
    if not args.no_append:
        add_section(args.results_file, section(args, r, command))
        print(f"recorded in {os.path.relpath(args.results_file, REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
