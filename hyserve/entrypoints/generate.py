"""`hyserve generate [MODEL] --prompt TEXT | --prompts-file FILE`: offline batch generation from the shell.

All prompts go to the engine at once (one batch, a progress bar on stderr); results go to stdout as text
or JSON lines, in prompt order. A bad input (missing file, invalid sampling parameter) exits non-zero
before any model is loaded; a prompt the engine rejects (too long) is reported and makes the exit code 1
while the other prompts still complete.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from hyserve.config import DEFAULT_MODEL
from hyserve.entrypoints.engine_args import add_engine_arguments, engine_kwargs_from_args

# EngineConfig fields without an engine flag here: the model is the positional MODEL, `--seed` is the
# sampling seed of every request, and nothing serves a model name
GENERATE_EXCLUDED = frozenset({"model", "seed", "served_model_name"})


def add_generate_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("generate", help="generate completions for prompts, offline",
                              description="Generate completions for one prompt or a file of prompts.")
    p.add_argument("model", nargs="?", default=DEFAULT_MODEL, help=f"preset or model directory (default: {DEFAULT_MODEL})")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="one prompt")
    src.add_argument("--prompts-file", help="one prompt per line; in a .jsonl file a JSON string or {\"prompt\": ...}")
    s = p.add_argument_group("sampling")
    s.add_argument("--max-tokens", type=int, default=64)
    s.add_argument("--temperature", type=float, default=1.0)
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--top-k", type=int, default=0)
    s.add_argument("--seed", type=int, default=None, help="sampling seed, the same for every request")
    s.add_argument("--n", type=int, default=1, help="completions per prompt")
    s.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    s.add_argument("--ignore-eos", action="store_true")
    add_engine_arguments(p.add_argument_group("engine"), exclude=GENERATE_EXCLUDED)
    p.add_argument("--output", choices=["text", "jsonl"], default="text")
    p.set_defaults(func=run_generate)
    return p


def read_prompts(args: argparse.Namespace) -> list[str]:
    if args.prompt is not None:
        return [args.prompt]
    with open(args.prompts_file, encoding="utf-8") as f:
        lines = [line.rstrip("\n") for line in f]
    if not args.prompts_file.endswith(".jsonl"):
        return [line for line in lines if line.strip()]
    prompts = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{args.prompts_file}:{i}: not JSON ({e.msg})") from None
        prompt = item.get("prompt") if isinstance(item, dict) else item
        if not isinstance(prompt, str):
            raise ValueError(f"{args.prompts_file}:{i}: expected a JSON string or an object with a 'prompt' string")
        prompts.append(prompt)
    return prompts


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """EngineConfig keyword arguments from the engine flags that were given."""
    return engine_kwargs_from_args(args, exclude=GENERATE_EXCLUDED)


def run_generate(args: argparse.Namespace) -> int:
    from hyserve import LLM, SamplingParams
    from hyserve.models import CheckpointError, ConfigError

    try:
        prompts = read_prompts(args)
        if not prompts:
            raise ValueError(f"{args.prompts_file} holds no prompts")
        params = SamplingParams(
            n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
            stop=args.stop, ignore_eos=args.ignore_eos, max_tokens=args.max_tokens,
        )
        llm = LLM(args.model, **engine_kwargs(args))
    except (ValueError, KeyError, OSError, CheckpointError, ConfigError) as e:  # OSError: a missing prompts file
        print(f"hyserve generate: error: {e}", file=sys.stderr)
        return 2
    outputs = llm.generate(prompts, params)
    failed = 0
    for out in outputs:
        if out.error:
            failed += 1
            print(f"hyserve generate: request {out.request_id} failed: {out.error}", file=sys.stderr)
        for line in format_output(out, args.output):
            print(line)
    return 1 if failed else 0


def format_output(out, fmt: str) -> list[str]:
    if fmt == "jsonl":
        lines = []
        for c in out.outputs:
            row: dict[str, Any] = {
                "prompt": out.prompt, "index": c.index, "text": c.text, "token_ids": c.token_ids,
                "finish_reason": c.finish_reason, "num_cached_tokens": out.num_cached_tokens,
            }
            if out.error:
                row["error"] = out.error
            lines.append(json.dumps(row, ensure_ascii=False))
        return lines
    if out.error:
        return [f"# prompt {out.request_id}: {out.prompt!r}", f"# error: {out.error}", ""]
    lines = [f"# prompt {out.request_id}: {out.prompt!r}"]
    for c in out.outputs:
        head = f"# completion {c.index} ({c.finish_reason}, {len(c.token_ids)} tokens)"
        lines += [head, c.text]
    return lines + [""]
