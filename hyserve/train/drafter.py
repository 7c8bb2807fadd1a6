"""`python -m hyserve.train.drafter`: train the DSpark drafter of a target checkpoint and save it.

    python -m hyserve.train.drafter --target hyserve/assets/hyserve-tiny-k3 \
        --out $OUT/hyserve-tiny-k3-dspark --deadline-minutes 5.5 [--generate 4096]

Data: the stdlib corpus the target was trained on (hyserve/train/data.py), split by module as the
target's own training split it; with --generate N, also the target's own continuations (temperature 1)
of N training prompts, which is the text a drafter sees when serving (DSpark regenerates its data with
the target for the same reason). Held-out acceptance is measured on continuations of held-out prompts:
sampled at temperature 1 (expected tokens per step) and greedy (greedy tokens per step). Writes the
drafter (config.json, model.safetensors) to --out and dspark_summary.json beside it.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

import torch

from hyserve.train.dspark import DrafterTrainConfig, evaluate_drafter, train_drafter

Example = tuple[list[int], list[int]]


def corpus_examples(tok, modules: list[str] | None, max_len: int) -> tuple[list[Example], list[Example]]:
    """(train, held-out) examples of the corpus, held-out by the target's own module split."""
    from hyserve.train.data import build_corpus, encode_corpus, split_modules, stdlib_modules

    train_mods, eval_mods = split_modules(modules or stdlib_modules())
    if not eval_mods:  # a short module list may hold none out: keep the last one for evaluation
        train_mods, eval_mods = train_mods[:-1], train_mods[-1:]
    train = encode_corpus(tok, build_corpus(train_mods, seed=0, phrasings=1), max_len)
    held = encode_corpus(tok, build_corpus(eval_mods, seed=1, phrasings=1), max_len)
    return train, held


def prompts_of(examples: list[Example], n: int, code_prefix: int = 48) -> list[list[int]]:
    """Up to n prompts: a conversation up to its first trained (assistant) token, a code chunk's start."""
    out = []
    for ids, mask in examples:
        first = next((i for i, m in enumerate(mask) if m), None)
        if first is None:
            continue
        prompt = ids[:code_prefix] if first == 0 else ids[:first]
        if len(prompt) >= 2:
            out.append(prompt)
        if len(out) == n:
            break
    return out


def target_llm(target_dir: str, device: str):
    """The target in the engine, eager, with a third of the GPU for its pools: the training that follows
    needs the rest."""
    from hyserve import LLM

    extra = {"gpu_memory_utilization": 0.3, "max_num_seqs": 256} if device == "cuda" else {"max_num_seqs": 8}
    return LLM(model=target_dir, device=device, enforce_eager=True, **extra)


def continuations(llm, prompts: list[list[int]], max_tokens: int, temperature: float, seed: int = 0) -> list[Example]:
    """The target's continuations through the engine, as examples trained on the continuation only."""
    from hyserve import SamplingParams

    if not prompts:
        return []
    torch.manual_seed(seed)  # unseeded requests draw from the global generator: one fast batched draw per step
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, skip_special_tokens=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    res = []
    for p, o in zip(prompts, outs):
        gen = list(o.outputs[0].token_ids)
        if gen:
            res.append((p + gen, [0] * len(p) + [1] * len(gen)))
    return res


def run(args: argparse.Namespace) -> dict:
    from hyserve.models.loader import load_model
    from hyserve.ops.dispatch import has_fla
    from hyserve.spec_decode.dspark_io import save_drafter, target_info
    from hyserve.tokenizer import load_tokenizer

    t0 = time.perf_counter()
    deadline = t0 + args.deadline_minutes * 60 - args.eval_reserve if args.deadline_minutes else float("inf")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.autotune_configs and device == "cuda" and has_fla():
        from hyserve.train.packed import limit_fla_autotune

        print(f"fla autotuners trimmed to {args.autotune_configs} configs: {limit_fla_autotune(args.autotune_configs)}",
              flush=True)
    tok = load_tokenizer(args.target, "k3")
    pad = tok.special_id("<|reserved_token_4|>")
    train, held = corpus_examples(tok, args.modules.split(",") if args.modules else None, args.row_len)
    data: dict[str, list[Example]] = {"corpus": train}
    held_sets: dict[str, list[Example]] = {"held-out corpus": held}
    if args.generate:
        llm = target_llm(args.target, device)
        data["generated"] = continuations(llm, prompts_of(train[::-1], args.generate), args.gen_tokens, 1.0)
        eval_prompts = prompts_of(held, args.eval_prompts)
        held_sets["held-out generations, T=1"] = continuations(llm, eval_prompts, args.gen_tokens, 1.0, seed=10**6)
        held_sets["held-out generations, greedy"] = continuations(llm, eval_prompts, args.gen_tokens, 0.0)
        del llm
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    prepared_s = time.perf_counter() - t0
    model = load_model(args.target, torch.float32, device)
    cfg = DrafterTrainConfig(block_size=args.block_size, num_layers=args.layers, anchors=args.anchors, rows=args.rows,
                             row_len=args.row_len, lr=args.lr, max_steps=args.max_steps,
                             time_budget_s=args.budget_minutes * 60, seed=args.seed, log_every=args.log_every)
    examples = [e for part in data.values() for e in part]
    print(f"{len(examples)} training examples ({', '.join(f'{k}: {len(v)}' for k, v in data.items())}); "
          f"prepared in {prepared_s:.0f}s", flush=True)
    drafter, log = train_drafter(model, examples, cfg, pad_id=pad, deadline=deadline, use_fla=not args.no_fla)
    save_drafter(drafter, args.out, target_info(model, os.path.basename(os.path.normpath(args.target))))
    ev = {name: evaluate_drafter(model, drafter, ex, cfg, pad_id=pad, batches=args.eval_batches,
                                 use_fla=not args.no_fla)
          for name, ex in held_sets.items() if ex}
    summary = {"config": {k: v for k, v in vars(args).items()}, "drafter": drafter.config.to_dict(),
               "parameters": sum(p.numel() for p in drafter.parameters()), "steps": log.steps,
               "warmup_s": log.warmup_s, "train_s": log.train_s, "used_fla": log.used_fla, "losses": log.losses,
               "train_tau_t1": log.tau_t1, "train_tau_greedy": log.tau_greedy, "eval": ev,
               "seconds": {"prepare": prepared_s, "total": time.perf_counter() - t0}}
    with open(os.path.join(os.path.dirname(os.path.abspath(args.out)), "dspark_summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(markdown(summary), flush=True)
    return summary


def markdown(s: dict) -> str:
    lines = [f"# DSpark drafter for {os.path.basename(os.path.normpath(s['config']['target']))}", "",
             f"- {s['parameters'] / 1e6:.2f}M parameters, block {s['drafter']['block_size']}, "
             f"{s['drafter']['num_layers']} layers, target layers {s['drafter']['target_layer_ids']}",
             f"- {s['steps']} steps in {s['train_s']:.0f}s after a {s['warmup_s']:.0f}s warm-up (fla: {s['used_fla']}); "
             f"loss {s['losses'][0]:.3f} -> {s['losses'][-1]:.3f}", "",
             "| held-out set | tokens/step T=1 | tokens/step greedy | acceptance by position (T=1) |",
             "| --- | --- | --- | --- |"]
    for name, m in s["eval"].items():
        lines.append(f"| {name} | {m['tau_t1']:.2f} | {m['tau_greedy']:.2f} | "
                     f"{' '.join(f'{a:.2f}' for a in m['accept_at'])} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hyserve.train.drafter")
    p.add_argument("--target", default="hyserve/assets/hyserve-tiny-k3", help="target checkpoint directory")
    p.add_argument("--out", required=True, help="drafter checkpoint directory")
    p.add_argument("--device", default=None)
    p.add_argument("--modules", default=None, help="comma-separated stdlib modules (default: all)")
    p.add_argument("--generate", type=int, default=0, help="train also on the target's continuations of N prompts")
    p.add_argument("--gen-tokens", type=int, default=192)
    p.add_argument("--eval-prompts", type=int, default=256)
    p.add_argument("--block-size", type=int, default=7)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--anchors", type=int, default=64)
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--row-len", type=int, default=1024)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--max-steps", type=int, default=10**9)
    p.add_argument("--budget-minutes", type=float, default=4.0, help="wall clock of the training steps")
    p.add_argument("--deadline-minutes", type=float, default=None, help="the whole run: the budget shrinks to fit")
    p.add_argument("--eval-reserve", type=float, default=40.0, help="seconds kept for saving and evaluating")
    p.add_argument("--eval-batches", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=100)
    p.add_argument("--autotune-configs", type=int, default=0,
                   help="keep this many configs per fla autotuner (0: all); shortens the first step's warm-up")
    p.add_argument("--no-fla", action="store_true", help="the torch reference KDA even on CUDA")
    args = p.parse_args(argv)
    if not os.path.isfile(os.path.join(args.target, "config.json")):
        p.error(f"--target {args.target}: no config.json there")
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
