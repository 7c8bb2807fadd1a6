"""TTFT of fresh prompts (random ids no earlier request shares, so no prefix hit) against a running server:
for each size the first request after the server is ready, then --repeats more (steady state). Streamed
completions of token ids with 2 output tokens, through `hyserve bench`'s client (gpu_issue24.ttft_ms).

    hyserve serve kimi-linear-48b-a3b --max-model-len 40960 --port 8123 &
    python benchmarks/cold_prefill.py --base-url http://127.0.0.1:8123 --model kimi-linear-48b-a3b
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_issue24 import Prompts, ttft_ms  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", required=True)
    p.add_argument("--sizes", default="1024,8192,32768")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--vocab", type=int, default=163840, help="the model's vocabulary (ids are drawn below it)")
    args = p.parse_args(argv)
    prompts = Prompts(7, args.vocab)
    print("| fresh prompt | TTFT, first after ready | " + " | ".join(["then"] * args.repeats) + " |")
    print("|---|" + "---|" * (1 + args.repeats))
    for n in (int(x) for x in args.sizes.split(",")):
        got = [asyncio.run(ttft_ms(args.base_url, args.model, prompts(n))) for _ in range(1 + args.repeats)]
        print(f"| {n} tokens | " + " | ".join(f"{g:.0f} ms" for g in got) + " |", flush=True)


if __name__ == "__main__":
    main()
