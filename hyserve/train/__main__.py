"""`python -m hyserve.train prepare|fit`: build the stdlib corpus + tokenizer, then train a checkpoint.

    python -m hyserve.train prepare --out .traindata            # corpus, BPE, encoded examples (CPU)
    python -m hyserve.train fit --data .traindata --out ckpt --time-budget 360 [--size small]
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


def prepare(out: str, vocab_size: int, modules: list[str] | None = None) -> None:
    from hyserve.tokenizer import load_tokenizer
    from hyserve.train.bpe import save_tokenizer, train_bpe
    from hyserve.train.data import build_corpus, encode_corpus, split_modules, stdlib_modules

    train_mods, eval_mods = split_modules(modules or stdlib_modules())
    corpus = build_corpus(train_mods)
    from hyserve.train.data import corpus_texts

    save_tokenizer(train_bpe(corpus_texts(corpus), vocab_size), out, MAX_LEN * 4)
    tok = load_tokenizer(out, "k3")
    torch.save(_flatten(encode_corpus(tok, corpus, MAX_LEN)), os.path.join(out, "train.pt"))
    held = build_corpus(eval_mods, seed=1, phrasings=1)
    json.dump({"train_modules": train_mods, "eval_modules": eval_mods,
               "eval_symbols": [dataclasses.asdict(s) for s in held.symbols]},
              open(os.path.join(out, "split.json"), "w"), indent=1)
    n = sum(1 for _ in open(os.path.join(out, "split.json")))
    print(f"prepared {out}: {len(corpus.symbols)} train symbols, {len(held.symbols)} held-out, {n} lines")


def fit(args: argparse.Namespace) -> None:
    from hyserve.tokenizer import load_tokenizer
    from hyserve.train.trainer import TrainConfig, k3_config, new_model, save_checkpoint, train

    tok = load_tokenizer(args.data, "k3")
    raw = k3_config(args.size, tok.vocab_size, tok.special_id("[BOS]"),
                    [tok.special_id("<|end_of_msg|>"), tok.special_id("[EOS]")], tok.special_id("<|reserved_token_4|>"))
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(args.seed)
    model = new_model(raw, device, args.seed)
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters on {device}", flush=True)
    examples = load_examples(os.path.join(args.data, "train.pt"))
    if args.check:  # the fla training path against the torch reference, same weights, one small batch
        from hyserve.ops.dispatch import reference_ops
        from hyserve.train.packed import masked_lm_loss, training_kernels

        few = examples[:8]
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            with training_kernels(model) as used:
                fast = masked_lm_loss(model, [e[0] for e in few], [e[1] for e in few])[0].item()
            with reference_ops():
                ref = masked_lm_loss(model, [e[0] for e in few], [e[1] for e in few])[0].item()
        print(f"check: fla path used={used} loss {fast:.5f}, reference {ref:.5f}", flush=True)
    cfg = TrainConfig(lr=args.lr, batch_tokens=args.batch_tokens, max_steps=args.max_steps,
                      time_budget_s=args.time_budget, seed=args.seed)
    t0 = time.perf_counter()
    losses = train(model, examples, cfg, use_fla=not args.no_fla)
    print(f"trained {time.perf_counter() - t0:.0f}s; loss first {losses[0]:.3f} last {losses[-1]:.3f}", flush=True)
    save_checkpoint(model, raw, args.data, args.out)
    with open(os.path.join(args.out, "train_log.json"), "w") as f:
        json.dump({"losses": losses, "config": dataclasses.asdict(cfg), "size": args.size,
                   "seconds": time.perf_counter() - t0, "device": device}, f)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hyserve.train")
    sub = p.add_subparsers(dest="cmd", required=True)
    pp = sub.add_parser("prepare")
    pp.add_argument("--out", required=True)
    pp.add_argument("--vocab-size", type=int, default=8192)
    pf = sub.add_parser("fit")
    pf.add_argument("--data", required=True)
    pf.add_argument("--out", required=True)
    pf.add_argument("--size", default="small")
    pf.add_argument("--device", default=None)
    pf.add_argument("--lr", type=float, default=2e-3)
    pf.add_argument("--batch-tokens", type=int, default=32768)
    pf.add_argument("--max-steps", type=int, default=10**9)
    pf.add_argument("--time-budget", type=float, default=float("inf"), help="seconds of training")
    pf.add_argument("--seed", type=int, default=0)
    pf.add_argument("--check", action="store_true", help="compare the fla path with the reference first")
    pf.add_argument("--no-fla", action="store_true", help="torch reference KDA even on CUDA")
    args = p.parse_args(argv)
    if args.cmd == "prepare":
        prepare(args.out, args.vocab_size)
    else:
        fit(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
