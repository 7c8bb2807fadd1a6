"""Speculative decoding off and on, side by side in one run: TPOT per batch size and the mean acceptance
length, each engine built by `LLM(...)` with and without `speculative_config` (issue 27's tables).

    # the embedded model and its drafter, held-out prompts (CUDA graphs; --eager for the eager side)
    python benchmarks/gpu_spec_decode.py --model hyserve/assets/hyserve-tiny-k3 --workload heldout \\
        --batches 1,8 --spec '{"method": "dspark", "model": "hyserve/assets/hyserve-tiny-k3-dspark"}'
    # the 48B shape: n-gram drafts on repetitive prompts, and the synthetic curve of 3.36 accepted at 4 drafts
    python benchmarks/gpu_spec_decode.py --workload repeat --batches 1,8,32 \\
        --spec '{"method": "ngram", "num_speculative_tokens": 4}' \\
        --spec '{"method": "ngram", "num_speculative_tokens": 4, "rejection_sample_method": "synthetic", "synthetic_acceptance_length": 4.36}'
    python benchmarks/gpu_spec_decode.py --model k3-tiny --device cpu --batches 1,2 --output-len 12 \\
        --spec '{"method": "ngram", "num_speculative_tokens": 3}' --no-append     # a CPU dry run

Per configuration one engine (max_num_seqs = the largest batch, prefix caching off, greedy, ignore_eos);
per batch size an untimed pass first (it compiles), then a timed one. The last column counts the requests
whose greedy tokens equal speculation off's (synthetic acceptance emits tokens the target did not choose:
not expected to match). TPOT = the time from the step in which
every request had its first token to the last request's end, over the output tokens after the first (what
a client streaming the batch waits per token). The acceptance length is vLLM's 1 + accepted / drafts over
the timed pass. Workloads: `heldout` (the prompts the drafter's training held out: the target's own held-out
modules, `hyserve.train.drafter`), `repeat` (a random 24-token pattern repeated: n-gram drafts find it),
`random` (random tokens).
"""

from __future__ import annotations

import argparse
import json
import random
import time

from hyserve import LLM, SamplingParams
from hyserve.engine.phases import PREFIX as PHASE_PREFIX

_HELD: dict = {}


def prompts_for(llm: LLM, workload: str, n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    vocab = min(1000, llm.engine.model_config.vocab_size)
    if workload == "random":
        return [[rng.randrange(10, vocab) for _ in range(length)] for _ in range(n)]
    if workload == "repeat":
        out = []
        for _ in range(n):
            pattern = [rng.randrange(10, vocab) for _ in range(24)]
            out.append((pattern * (length // 24 + 1))[:length])
        return out
    from hyserve.train.drafter import corpus_examples, prompts_of

    key = (llm.engine.cfg.model, length)
    if key not in _HELD:  # tokenizing the corpus takes seconds: once per model, not per engine and batch
        _HELD[key] = corpus_examples(llm.get_tokenizer(), None, max(length, 64))[1]
    prompts = prompts_of(_HELD[key], n)
    if len(prompts) < n:
        raise SystemExit(f"only {len(prompts)} held-out prompts for a batch of {n}")
    return prompts


def run_batch(llm: LLM, prompts: list[list[int]], output_len: int) -> tuple[float, list[list[int]]]:
    """TPOT in ms of one batch (see the module docstring), and each request's output tokens."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    started, t_first, tokens = set(), None, {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished_requests():
        for d in engine.step_deltas():
            if d.error:
                raise RuntimeError(f"request {d.request_id} failed: {d.error}")
            for c in d.completions:
                tokens[d.request_id] += c.token_ids
            if any(c.token_ids for c in d.completions):
                started.add(d.request_id)
        if t_first is None and len(started) == len(prompts):
            t_first = time.perf_counter()
    return (time.perf_counter() - t_first) / max(output_len - 1, 1) * 1e3, list(tokens.values())


def profile_batch(llm: LLM, prompts: list[list[int]], output_len: int) -> None:
    """Two more passes under torch.profiler, the batch's prompts with 1 and with output_len output tokens:
    their difference is the decode (or verify) steps alone, prefill left out. Prints the GPU kernel time
    per step (against the step's wall time, unprofiled: TPOT x tokens per step) and the kernels by time."""
    from torch.profiler import ProfilerActivity, profile

    counts = llm.engine.stats.steps.steps  # the engine's own step counters (hyserve:engine_steps)
    passes = []
    for n in (1, output_len):
        before = sum(counts.values())
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            run_batch(llm, prompts, n)
        kernels: dict[str, tuple[float, int]] = {}
        host: dict[str, float] = {}
        for e in prof.key_averages():
            if e.self_device_time_total > 0:
                ms, n = kernels.get(e.key, (0.0, 0))
                kernels[e.key] = ms + e.self_device_time_total / 1e3, n + e.count
            if e.key.startswith(PHASE_PREFIX):
                host[e.key[len(PHASE_PREFIX):]] = host.get(e.key[len(PHASE_PREFIX):], 0.0) + e.cpu_time_total / 1e3
        passes.append((sum(counts.values()) - before, kernels, host))
    (s0, k0, h0), (s1, k1, h1) = passes
    steps = max(s1 - s0, 1)
    per = {name: ((t - k0.get(name, (0.0, 0))[0]) / steps, (n - k0.get(name, (0.0, 0))[1]) / steps)
           for name, (t, n) in k1.items()}
    total, launches = sum(ms for ms, _ in per.values()), sum(n for _, n in per.values())
    print(f"  profile: {steps} steps after the first token; GPU kernels {total:.3f} ms a step in {launches:.0f} "
          "launches", flush=True)
    for name, (ms, n) in sorted(per.items(), key=lambda x: -x[1][0])[:40]:
        print(f"    {ms:8.3f} ms  {n:6.1f} x  {name[:90]}", flush=True)
    # the engine's named host phases (hyserve/engine/phases.py); they nest: land holds propose, and sample
    # and propose hold their read-backs (the wait for the GPU)
    phases = {name: max(0.0, t - h0.get(name, 0.0)) / steps for name, t in h1.items()}
    print("  host phases a step (ms): " + ", ".join(f"{k} {v:.3f}" for k, v in sorted(phases.items(), key=lambda x: -x[1])),
          flush=True)


def measure(args, spec: dict | None) -> tuple[dict[int, float], dict[int, float | None], dict[int, list]]:
    kw = dict(device=args.device, max_num_seqs=max(args.batch_list), enable_prefix_caching=False,
              max_model_len=args.prompt_len + args.output_len + 64, enforce_eager=args.eager)
    t0 = time.perf_counter()
    llm = LLM(args.model, speculative_config=spec, **kw) if spec is not None else LLM(args.model, **kw)
    # progress as it goes: a run cut short by its time limit still tells what it measured
    print(f"engine {json.dumps(spec)}: ready in {time.perf_counter() - t0:.1f} s", flush=True)
    tpot, accept, outputs = {}, {}, {}
    for b in args.batch_list:
        prompts = prompts_for(llm, args.workload, b, args.prompt_len, seed=b)
        run_batch(llm, prompts, min(16, args.output_len))  # compiles the shapes of this batch size
        stats = llm.engine.stats.spec_decode
        before = (stats.num_drafts, stats.num_accepted_tokens) if stats is not None else None
        tpot[b], outputs[b] = run_batch(llm, prompts, args.output_len)
        accept[b] = None if stats is None else \
            1 + (stats.num_accepted_tokens - before[1]) / max(stats.num_drafts - before[0], 1)
        print(f"  batch {b}: TPOT {tpot[b]:.2f} ms, acceptance length {accept[b]}", flush=True)
        if b == args.profile_batch:
            profile_batch(llm, prompts, args.output_len)
    del llm
    return tpot, accept, outputs


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="kimi-linear-48b-a3b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--workload", choices=("heldout", "repeat", "random"), default="repeat")
    p.add_argument("--spec", action="append", required=True, help="a --speculative-config JSON (repeatable)")
    p.add_argument("--eager", action="store_true", help="--enforce-eager for every engine")
    p.add_argument("--profile-batch", type=int, default=None,
                   help="profile one more pass of this batch size (steps' wall time against GPU kernel time)")
    p.add_argument("--no-append", action="store_true", help="print only; leave docs/BENCHMARKS.md alone")
    args = p.parse_args(argv)
    args.batch_list = [int(b) for b in args.batches.split(",")]
    specs = [json.loads(s) for s in args.spec]
    off, _, plain = measure(args, None)
    table = ["| speculative config | batch | TPOT off ms | TPOT on ms | off / on | mean acceptance length "
             "| requests with off's tokens |", "|---|---|---|---|---|---|---|"]
    for spec in specs:
        on, accept, got = measure(args, spec)
        for b in args.batch_list:
            same = sum(x == y for x, y in zip(got[b], plain[b]))
            table.append(f"| `{json.dumps(spec)}` | {b} | {off[b]:.2f} | {on[b]:.2f} | {off[b] / on[b]:.2f}x | "
                         f"{accept[b]:.2f} | {same}/{b} |")
    notes = [f"Workload `{args.workload}`, prompts of {args.prompt_len} tokens ({'held-out, their own lengths' if args.workload == 'heldout' else 'fixed'}), "
             f"{args.output_len} output tokens, greedy, prefix caching off, {'eager' if args.eager else 'CUDA graphs'}."]
    from gpu_common import print_or_report

    print_or_report("gpu_spec_decode.py", argv, f"Speculative decoding off and on, {args.model}", table, notes,
                    "gpu_spec_decode.md", args.no_append or args.device != "cuda")


if __name__ == "__main__":
    main()
