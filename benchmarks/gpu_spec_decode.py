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
from hyserve.engine.phases import timed

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
    """Passes of the batch's prompts with 1 and with output_len output tokens, whose difference is the decode
    (or verify) steps alone, prefill left out: under torch.profiler, the GPU kernels a step (against the
    step's wall time, unprofiled: TPOT x tokens per step); clocked without a profiler (phases.timed: the
    profiler's per-op records inflate host time several-fold), the engine's host phases a step; then the
    step's CUDA graph replayed alone (`replay_alone`)."""
    from torch.profiler import ProfilerActivity, profile

    counts = llm.engine.stats.steps.steps  # the engine's own step counters (hyserve:engine_steps)
    passes = []
    for n in (1, output_len):
        before = sum(counts.values())
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            run_batch(llm, prompts, n)
        kernels: dict[str, tuple[float, int]] = {}
        for e in prof.key_averages():
            if e.self_device_time_total > 0 and not e.key.startswith(PHASE_PREFIX):
                ms, c = kernels.get(e.key, (0.0, 0))
                kernels[e.key] = ms + e.self_device_time_total / 1e3, c + e.count
        passes.append((sum(counts.values()) - before, kernels))
    (s0, k0), (s1, k1) = passes
    steps = max(s1 - s0, 1)
    per = {name: ((t - k0.get(name, (0.0, 0))[0]) / steps, (n - k0.get(name, (0.0, 0))[1]) / steps)
           for name, (t, n) in k1.items()}
    total, launches = sum(ms for ms, _ in per.values()), sum(n for _, n in per.values())
    print(f"  profile: {steps} steps after the first token; GPU kernels {total:.3f} ms a step in {launches:.0f} "
          "launches", flush=True)
    for name, (ms, n) in sorted(per.items(), key=lambda x: -x[1][0])[:40]:
        print(f"    {ms:8.3f} ms  {n:6.1f} x  {name[:90]}", flush=True)
    clocks = []
    for n in (1, output_len):
        before = sum(counts.values())
        with timed() as clock:
            t0 = time.perf_counter()
            run_batch(llm, prompts, n)
            wall = time.perf_counter() - t0
        clocks.append((sum(counts.values()) - before, dict(clock), wall))
    (s0, c0, w0), (s1, c1, w1) = clocks
    steps = max(s1 - s0, 1)
    # they nest: land holds propose, and sample and propose hold their read-backs (the wait for the GPU)
    phases = {name: max(0.0, t - c0.get(name, (0.0, 0))[0]) / steps * 1e3 for name, (t, _) in c1.items()}
    print(f"  host phases a step, unprofiled (ms; a step takes {(w1 - w0) / steps * 1e3:.3f}): "
          + ", ".join(f"{k} {v:.3f}" for k, v in sorted(phases.items(), key=lambda x: -x[1])), flush=True)
    replay_alone(llm, prompts[0])


def replay_alone(llm: LLM, prompt: list[int], n: int = 50) -> None:
    """The GPU time of a step's CUDA graph replayed back to back (no host work between the steps): one
    request decodes until a step replays the graph of 1 row of 1 + k tokens (k the config's drafts, 0
    without speculation), that graph replays n times over its static inputs (rewriting the request's own
    rows and state columns), and the request is aborted. A step's wall time minus this is the host's share."""
    import torch

    engine = llm.engine
    graphs, spec = engine.runner.graphs, engine.cfg.speculative_config
    want = (1, 1 + (spec.num_speculative_tokens if spec is not None else 0))
    if graphs is None or want not in graphs.graphs:
        return
    engine.add_request("replay-alone", prompt, SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True))
    for _ in range(2):  # its prompt, then a graph step of its own (last_key no longer an earlier batch's)
        engine.step_deltas()
    while engine.has_unfinished_requests() and graphs.last_key != want:
        engine.step_deltas()
    if graphs.last_key == want:
        graph = graphs.graphs[want]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        graph.replay()
        start.record()
        for _ in range(n):
            graph.replay()
        end.record()
        end.synchronize()
        print(f"  graph of {want[0]} row x {want[1]} tokens replayed alone: {start.elapsed_time(end) / n:.3f} ms a step",
              flush=True)
    engine.abort_request("replay-alone")
    while engine.has_unfinished_requests():
        engine.step_deltas()


def measure(args, spec: dict | None) -> tuple[dict[int, float], dict[int, float | None], dict[int, list]]:
    kw = dict(device=args.device, max_num_seqs=max(args.batch_list), enable_prefix_caching=False,
              max_model_len=args.prompt_len + args.output_len + 64, enforce_eager=args.eager)
    t0 = time.perf_counter()
    llm = LLM(args.model, speculative_config=spec, **kw) if spec is not None else LLM(args.model, **kw)
    # progress as it goes: a run cut short by its time limit still tells what it measured
    print(f"engine {json.dumps(spec)}: ready in {time.perf_counter() - t0:.1f} s", flush=True)
    if llm.engine.memory_profile is not None:  # what the cache was sized around
        print(f"  {llm.engine.memory_profile.describe()}; {llm.engine.cache_plan.describe()}", flush=True)
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
