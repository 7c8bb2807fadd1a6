"""Engine decode steps with and without CUDA graphs, side by side in one run: the whole engine path
(scheduler, model runner, sampler, output) on the kimi-linear-48b-a3b preset with random bf16 weights.

    python benchmarks/gpu_engine_decode.py                 # one H200; appends to docs/BENCHMARKS.md
    python benchmarks/gpu_engine_decode.py --model k3-tiny --device cpu --batches 1,3 --no-append  # dry run

For each batch size n, n requests with 512-token random prompts generate --output-len tokens (ignore_eos);
decode-only steps are timed on the host (what a client waits for) with an eager engine, with decode
graphs, and with graphs and async scheduling (host work overlapping the GPU), each engine built by `LLM(...)` as users build it
(product loader, cache sizing, graph capture), each after an untimed 3-token pass of the same prompts (kernel
compilation). The floor is the bytes a step must read at the measured copy bandwidth (benchmarks/gpu_decode.py's
count). On the CPU (a dry run) every mode runs eagerly: graphs exist only on CUDA.
"""

from __future__ import annotations

import argparse
import gc
import statistics

import torch
from offline_throughput import timed_batch

from hyserve import LLM, SamplingParams

PROMPT = 512


def decode_ms(args, n: int, graphs: bool, async_sched: bool = False) -> tuple[float, int, object]:
    """(host ms per decode-only step, graphs captured, model config) for n requests decoding together."""
    llm = LLM(args.model, device=args.device, max_num_seqs=max(args.batch_list),
              max_model_len=PROMPT + args.output_len + 64, enforce_eager=not graphs,
              enable_prefix_caching=False, async_scheduling=async_sched)
    engine = llm.engine
    captured = len(engine.runner.graphs.graphs) if engine.runner.graphs is not None else 0
    model_config = engine.model_config
    gen = torch.Generator().manual_seed(n)
    prompts = [torch.randint(0, min(1000, model_config.vocab_size), (PROMPT,), generator=gen).tolist() for _ in range(n)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    # a short untimed pass first: Triton compiles a kernel on its first call, which an eager engine
    # would otherwise time inside its first decode step (graphs compile theirs at capture)
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    passes = []
    for _ in range(args.repeats):
        _, phases = timed_batch(llm, prompts, params)
        passes.append(phases.decode_seconds / (phases.decode_tokens / n) * 1e3)
    if args.profile and not graphs:
        profile_steps(llm, prompts, f"eager, batch {n}")
    del engine, llm  # the LLM holds the engine, and with it the weights and the cache pool
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    args.passes[(n, graphs, async_sched)] = passes
    return statistics.median(passes), captured, model_config


def profile_steps(llm, prompts: list[list[int]], what: str, steps: int = 24) -> None:
    """A cProfile of `steps` engine steps past the prefill: host work per step, function by function
    (what an eager step's time is made of; run it on both sides of a comparison)."""
    import cProfile
    import pstats

    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=steps + 4, ignore_eos=True)  # decoding throughout
    for i, p in enumerate(prompts):
        engine.add_request(f"profile-{i}", p, params)
    while engine.last_step is None or engine.last_step.num_prompt_tokens:
        engine.step()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        engine.step()
    prof.disable()
    stats = pstats.Stats(prof)
    print(f"cProfile, {what}: {stats.total_calls / steps:.0f} Python calls per step", flush=True)
    stats.sort_stats("tottime").print_stats(25)
    for i in range(len(prompts)):
        engine.abort_request(f"profile-{i}")
    while engine.has_unfinished_requests():
        engine.step()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="kimi-linear-48b-a3b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--batches", default="1,8,64")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=1, help="timed passes per engine (the median is reported)")
    p.add_argument("--profile", action="store_true", help="print a cProfile of 24 eager steps per batch size")
    p.add_argument("--no-append", action="store_true", help="print only; leave docs/BENCHMARKS.md alone")
    args = p.parse_args(argv)
    args.passes = {}
    args.batch_list = [int(b) for b in args.batches.split(",")]
    cuda = args.device == "cuda"
    ceil = None
    if cuda:
        from gpu_common import ceilings

        ceil = ceilings()
    table = ["| batch | eager ms/step | graphs ms/step | graphs + async scheduling ms/step | eager/graphs | "
             "graphs/async | graphs captured | floor | floor/graphs | floor/async |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for n in args.batch_list:
        eager, _, model_config = decode_ms(args, n, graphs=False)
        graphed, captured, _ = decode_ms(args, n, graphs=True)
        overlapped, _, _ = decode_ms(args, n, graphs=True, async_sched=True)
        floor, ratio, ratio_async = "n/a", "n/a", "n/a"
        if ceil is not None:
            from gpu_decode import step_bytes

            ms = step_bytes(model_config, n, PROMPT + args.output_len // 2) / (ceil["copy_tbs"] * 1e12) * 1e3
            floor, ratio, ratio_async = f"{ms:.2f} ms", f"{ms / graphed:.0%}", f"{ms / overlapped:.0%}"
        table.append(f"| {n} | {eager:.2f} | {graphed:.2f} | {overlapped:.2f} | {eager / graphed:.2f}x | "
                     f"{graphed / overlapped:.2f}x | {captured} | {floor} | {ratio} | {ratio_async} |")
    notes = [f"Prompts of {PROMPT} tokens, {args.output_len} output tokens, prefix caching off; host time of the "
             "decode-only steps (scheduler, runner, sampler included)."]
    if args.repeats > 1:
        modes = {(False, False): "eager", (True, False): "graphs", (True, True): "graphs + async"}
        notes.append(f"Median of {args.repeats} timed passes per engine; the passes: " + "; ".join(
            f"batch {n} {modes[g, a]} " + ", ".join(f"{x:.2f}" for x in v) for (n, g, a), v in args.passes.items()) + ".")
    if ceil is not None:
        notes.append(f"Copy bandwidth in this run: {ceil['copy_tbs']:.2f} TB/s.")
    from gpu_common import print_or_report

    print_or_report("gpu_engine_decode.py", argv, f"Engine decode with and without CUDA graphs, {args.model}", table,
                    notes, "gpu_engine_decode.md", args.no_append or not cuda)


if __name__ == "__main__":
    main()
