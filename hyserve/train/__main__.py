"""`python -m hyserve.train prepare|fit|all|expected` (hyserve/train/README.md has the device command).

    python -m hyserve.train prepare --out .traindata            # corpus, BPE, encoded examples (CPU)
    python -m hyserve.train fit --data .traindata --out ckpt --time-budget 360 [--size small]
    python -m hyserve.train all --out $OUT/hyserve-tiny-k3 --deadline-minutes 9.5   # all of it, then eval
    python -m hyserve.train expected --model hyserve/assets/hyserve-tiny-k3        # the test's completion
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import torch

MAX_LEN = 1024


def _flatten(examples: list[tuple[list[int], list[int]]]) -> dict[str, torch.Tensor]:
    lens = torch.tensor([len(e[0]) for e in examples], dtype=torch.long)
    return {
        "ids": torch.tensor([t for e in examples for t in e[0]], dtype=torch.int16),  # vocab < 32768
        "mask": torch.tensor([m for e in examples for m in e[1]], dtype=torch.uint8),
        "offsets": torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)]),
    }


def load_examples(path: str) -> list[tuple[list[int], list[int]]]:
    d = torch.load(path)
    ids, mask, off = d["ids"].tolist(), d["mask"].tolist(), d["offsets"].tolist()
    return [(ids[a:b], mask[a:b]) for a, b in zip(off[:-1], off[1:])]


def prepare(out: str, vocab_size: int, modules: list[str] | None = None, copies: float = 2.0,
            tokenizer_from: str | None = None, choices: float = 0.3, seed: int = 0, talk: float = 0.15) -> None:
    """Corpus from `modules` (default: the whole stdlib here), BPE (or the tokenizer of the checkpoint
    `tokenizer_from`, to go on training it), encoded examples, the held-out split. Another `seed` draws
    other phrasings and made-up symbols (a second run on fresh copying examples); the split stays."""
    import shutil

    from hyserve.tokenizer import load_tokenizer
    from hyserve.train.bpe import save_tokenizer, train_bpe
    from hyserve.train.data import build_corpus, encode_corpus, split_modules, stdlib_modules

    train_mods, eval_mods = split_modules(modules or stdlib_modules())
    corpus = build_corpus(train_mods, seed=seed, copies=copies, choices=choices, talk=talk)
    from hyserve.train.data import corpus_texts

    if tokenizer_from:
        os.makedirs(out, exist_ok=True)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(os.path.join(tokenizer_from, name), out)
    else:
        save_tokenizer(train_bpe(corpus_texts(corpus), vocab_size), out, MAX_LEN * 4)
    tok = load_tokenizer(out, "k3")
    torch.save(_flatten(encode_corpus(tok, corpus, MAX_LEN)), os.path.join(out, "train.pt"))
    held = build_corpus(eval_mods, seed=1, phrasings=1)
    json.dump({"train_modules": train_mods, "eval_modules": eval_mods,
               "eval_symbols": [dataclasses.asdict(s) for s in held.symbols]},
              open(os.path.join(out, "split.json"), "w"), indent=1)
    n = sum(1 for _ in open(os.path.join(out, "split.json")))
    print(f"prepared {out}: {len(corpus.symbols)} train symbols, {len(corpus.copy)} made-up-symbol tool "
          f"conversations, {len(corpus.talk)} small-talk exchanges, {len(held.symbols)} held-out symbols, {n} lines")


def model_config(args: argparse.Namespace, tok) -> dict:
    from hyserve.train.trainer import k3_config

    return k3_config(args.size, tok.vocab_size, tok.special_id("[BOS]"),
                     [tok.special_id("<|end_of_msg|>"), tok.special_id("[EOS]")], tok.special_id("<|reserved_token_4|>"))


def fit(args: argparse.Namespace, deadline: float = float("inf")) -> dict:
    """Train on prepared data and save the checkpoint; returns what train_log.json holds."""
    from hyserve.tokenizer import load_tokenizer
    from hyserve.train.trainer import TrainConfig, new_model, save_checkpoint, train

    tok = load_tokenizer(args.data, "k3")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(args.seed)
    if args.init_from:  # go on training a checkpoint (fresh optimizer state, a new warm-up and schedule)
        from hyserve.models.loader import load_model

        with open(os.path.join(args.init_from, "config.json")) as f:
            raw = json.load(f)
        model = load_model(args.init_from, torch.float32, device).train().requires_grad_(True)
    else:
        raw = model_config(args, tok)
        model = new_model(raw, device, args.seed)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.1f}M parameters on {device}", flush=True)
    examples = load_examples(os.path.join(args.data, "train.pt"))
    if args.check:  # the fla training path against the torch reference, same weights, one small batch
        from hyserve.ops.dispatch import reference_ops
        from hyserve.train.packed import masked_lm_loss

        few = examples[:8]
        plan = model.kernel_plan.for_training()
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            fast = masked_lm_loss(model, [e[0] for e in few], [e[1] for e in few], plan)[0].item()
            with reference_ops():
                ref = masked_lm_loss(model, [e[0] for e in few], [e[1] for e in few])[0].item()
        print(f"check: fla path used={plan.train_fla} loss {fast:.5f}, reference {ref:.5f}", flush=True)
    cfg = TrainConfig(lr=args.lr, rows=args.rows, row_len=args.row_len, max_steps=args.max_steps,
                      time_budget_s=args.time_budget, autotune_configs=args.autotune_configs, seed=args.seed,
                      log_every=args.log_every)
    t0 = time.perf_counter()
    log = train(model, examples, cfg, pad_id=tok.special_id("<|reserved_token_4|>"), use_fla=not args.no_fla,
                deadline=deadline)
    print(f"trained {log.steps} steps in {log.train_s:.0f}s ({log.tokens_per_s:,.0f} tok/s) after a "
          f"{log.warmup_s:.0f}s warm-up; loss first {log.losses[0]:.3f} last {log.losses[-1]:.3f}", flush=True)
    save_checkpoint(model, raw, args.data, args.out)
    record = {"size": args.size, "parameters": n_params, "device": device, "config": dataclasses.asdict(cfg),
              "seconds": time.perf_counter() - t0, **dataclasses.asdict(log), "tokens_per_s": log.tokens_per_s}
    record["config"]["time_budget_s"] = min(record["config"]["time_budget_s"], 1e12)  # JSON has no inf
    with open(os.path.join(args.work if hasattr(args, "work") else args.out, "train_log.json"), "w") as f:
        json.dump(record, f)
    return record


def run_all(args: argparse.Namespace) -> dict:
    """prepare -> fit -> evaluate, inside `--deadline-minutes` of wall clock from the start (the training
    budget is what is left after the warm-up pass, less `--eval-reserve`). Writes the checkpoint to
    --out and summary.json beside it; data, logs and summary.md stay in --work."""
    from hyserve.train.evaluate import evaluate_split
    from hyserve.train.report import markdown

    t0 = time.perf_counter()
    deadline = t0 + args.deadline_minutes * 60 - args.eval_reserve if args.deadline_minutes else float("inf")
    os.makedirs(args.work, exist_ok=True)
    if args.data is None:
        args.data = os.path.join(args.work, "data")
        prepare(args.data, args.vocab_size, args.modules.split(",") if args.modules else None, args.copies,
                tokenizer_from=args.init_from, choices=args.choices, seed=args.seed, talk=args.talk)
    prepared_s = time.perf_counter() - t0
    args.time_budget = args.budget_minutes * 60
    train_log = fit(args, deadline)
    t1 = time.perf_counter()
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    kwargs = {"device": device, "enforce_eager": True, "max_num_seqs": 256 if device == "cuda" else 16}
    ev = evaluate_split(args.out, os.path.join(args.data, "split.json"), args.eval_n, **kwargs)
    summary = {"train": {k: v for k, v in train_log.items() if k != "losses"}, "losses": train_log["losses"],
               "eval": ev, "seconds": {"prepare": prepared_s, "eval": time.perf_counter() - t1,
                                       "total": time.perf_counter() - t0}}
    with open(os.path.join(os.path.dirname(os.path.abspath(args.out)), "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    md = markdown(summary)
    with open(os.path.join(args.work, "summary.md"), "w") as f:
        f.write(md)
    print(md, flush=True)
    return summary


def write_expected(model_dir: str, out: str, prompt: str) -> dict:
    """The greedy completion tests/test_trained_model.py checks, computed the way the test does (CPU)."""
    from hyserve import LLM, SamplingParams

    llm = LLM(model=model_dir, max_num_seqs=4, device="cpu")
    text = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)[0].outputs[0].text
    record = {"prompt": prompt, "completion": text}
    with open(out, "w") as f:
        json.dump(record, f, indent=1)
    return record


def _train_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="checkpoint directory")
    p.add_argument("--size", default="small")
    p.add_argument("--device", default=None)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--rows", type=int, default=32, help="sequences per step")
    p.add_argument("--row-len", type=int, default=1024, help="tokens per sequence (a multiple of 64)")
    p.add_argument("--max-steps", type=int, default=10**9)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--init-from", default=None,
                   help="start from this checkpoint (its config and, with `all`, its tokenizer) instead of random")
    p.add_argument("--check", action="store_true", help="compare the fla path with the reference first")
    p.add_argument("--no-fla", action="store_true", help="torch reference KDA even on CUDA")
    p.add_argument("--autotune-configs", type=int, default=0,
                   help="keep this many configs per fla autotuner (0: all); shortens the first step's warm-up")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hyserve.train")
    sub = p.add_subparsers(dest="cmd", required=True)
    pp = sub.add_parser("prepare")
    pp.add_argument("--out", required=True)
    pp.add_argument("--vocab-size", type=int, default=8192)
    pp.add_argument("--copies", type=float, default=2.0, help="made-up-symbol tool conversations per symbol")
    pp.add_argument("--choices", type=float, default=0.3,
                    help="exchanges per symbol under tool_choice required, and as many under none")
    pp.add_argument("--seed", type=int, default=0, help="draws the phrasings and made-up symbols")
    pp.add_argument("--talk", type=float, default=0.15,
                    help="greeting, identity and out-of-scope exchanges per symbol")
    pf = sub.add_parser("fit")
    pf.add_argument("--data", required=True)
    pf.add_argument("--time-budget", type=float, default=float("inf"), help="seconds of training")
    _train_args(pf)
    pa = sub.add_parser("all", help="prepare, fit and evaluate in one run")
    _train_args(pa)
    pa.add_argument("--work", default="/tmp/hyserve-train", help="data, logs and summary.md")
    pa.add_argument("--data", default=None, help="data already written by `prepare` (skips that step)")
    pa.add_argument("--vocab-size", type=int, default=8192)
    pa.add_argument("--copies", type=float, default=2.0, help="made-up-symbol tool conversations per symbol")
    pa.add_argument("--choices", type=float, default=0.3,
                    help="exchanges per symbol under tool_choice required, and as many under none")
    pa.add_argument("--talk", type=float, default=0.15,
                    help="greeting, identity and out-of-scope exchanges per symbol")
    pa.add_argument("--modules", default=None, help="comma-separated stdlib modules (default: all)")
    pa.add_argument("--budget-minutes", type=float, default=14.0, help="wall clock of the training steps")
    pa.add_argument("--deadline-minutes", type=float, default=None,
                    help="the whole run's wall clock: the training budget shrinks to fit it")
    pa.add_argument("--eval-reserve", type=float, default=120.0, help="seconds kept for saving and evaluating")
    pa.add_argument("--eval-n", type=int, default=200)
    pe = sub.add_parser("expected", help="write the shipped model's fixed greedy completion for the tests")
    pe.add_argument("--model", default="hyserve/assets/hyserve-tiny-k3")
    pe.add_argument("--out", default="tests/data/hyserve_tiny_k3_expected.json")
    pe.add_argument("--prompt", default="import json\n\n\ndef load(path):\n")
    args = p.parse_args(argv)
    for flag, name in (("init_from", "config.json"), ("data", "train.pt")):
        where = getattr(args, flag, None)
        if where and not os.path.isfile(os.path.join(where, name)):
            p.error(f"--{flag.replace('_', '-')} {where}: no {name} there")
    if args.cmd == "prepare":
        prepare(args.out, args.vocab_size, copies=args.copies, choices=args.choices, seed=args.seed, talk=args.talk)
    elif args.cmd == "fit":
        fit(args)
    elif args.cmd == "all":
        run_all(args)
    else:
        print(json.dumps(write_expected(args.model, args.out, args.prompt.encode().decode("unicode_escape"))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
