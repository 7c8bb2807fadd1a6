"""Host time of preparing one decode step's inputs (the model runner's work around the forward), on the CPU.

Async scheduling hides host work behind the GPU only while it stays small, so this times what the runner
does for a decode step of n requests with the forward and the logits stubbed out: building the step's
inputs and copying them to the device, eagerly and through the CUDA-graph static buffers (which on the
CPU run the same code without capture).

    python benchmarks/host_step_prep.py                   # k3-tiny, batches 1 and 64
    python benchmarks/host_step_prep.py --batches 1,8,64 --iters 3000
"""

from __future__ import annotations

import argparse
import time

import torch

from hyserve import SamplingParams
from hyserve.config import EngineConfig
from hyserve.engine.llm_engine import LLMEngine
from hyserve.models.loader import load_model
from hyserve.tokenizer import load_tokenizer


def decode_step(engine: LLMEngine, n: int, prompt: int):
    """A scheduled decode step of n requests (their prompts prefilled)."""
    params = SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True)
    for i in range(n):
        engine.add_request(str(i), [(7 * i + j) % 200 + 1 for j in range(prompt)], params)
    while True:
        engine.step()
        out = engine.scheduler.schedule()
        if all(s.num_new_tokens == 1 for s in out.seqs) and len(out.seqs) == n:
            return out
        raise RuntimeError("the prompts did not prefill in one step: raise --max-num-batched-tokens")


def time_execute(engine: LLMEngine, out, iters: int) -> float:
    """Microseconds of CPU time per runner.execute(out) with the forward stubbed: the best of 7 runs
    (process time and the minimum, so other work on a shared machine counts as little as it can)."""
    model = engine.model
    vocab = model.config.vocab_size
    model.forward = lambda ids, batch, cache: torch.zeros(ids.shape[0], 1)
    model.compute_logits = lambda h, out=None: out if out is not None else torch.zeros(h.shape[0], vocab)
    runs = []
    for _ in range(7):
        t0 = time.process_time()
        for _ in range(iters):
            engine.runner.execute(out)
        runs.append((time.process_time() - t0) / iters * 1e6)
    del model.forward, model.compute_logits
    return min(runs)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="k3-tiny")
    p.add_argument("--batches", default="1,64")
    p.add_argument("--prompt", type=int, default=40)
    p.add_argument("--iters", type=int, default=2000)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    model = load_model(args.model, dtype="float32", device="cpu", seed=0)
    tok = load_tokenizer(None, model.config.tokenizer_family)
    print("| batch | eager us/step | graph buffers us/step |\n|---|---|---|")
    for n in [int(b) for b in args.batches.split(",")]:
        row = []
        for graphs in (False, True):
            cfg = EngineConfig(model=args.model, device="cpu", block_size=16, kv_cache_memory_bytes=64 << 20,
                               max_num_seqs=max(n, 2), max_num_batched_tokens=max(2048, n * args.prompt),
                               enable_prefix_caching=False, async_scheduling=False)
            engine = LLMEngine(cfg, model=model, tokenizer=tok, static_decode_buffers=graphs)
            row.append(time_execute(engine, decode_step(engine, n, args.prompt), args.iters))
        print(f"| {n} | {row[0]:.1f} | {row[1]:.1f} |")


if __name__ == "__main__":
    main()
