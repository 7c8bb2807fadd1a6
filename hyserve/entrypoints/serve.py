"""`hyserve serve [MODEL]`: flags follow `vllm serve` (DESIGN.md §8). Runnable as a module for tests:
`python -m hyserve.entrypoints.serve k3-tiny --port 8000`."""

from __future__ import annotations

import argparse

from hyserve.config import DEFAULT_MODEL
from hyserve.entrypoints.engine_args import add_cache_arguments


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None, help=f"model directory or preset (default: {DEFAULT_MODEL})")
    p.add_argument("--model", dest="model_flag", default=None, help="same as the positional MODEL")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None, help="the name clients use (default: MODEL)")
    p.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` on /v1 endpoints")
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--gpu-memory-utilization", type=float, default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None)
    # Retention policies of the prefix cache (DESIGN.md §5), switchable one by one so benchmarks can compare them;
    # the interval policy is --prefix-cache-retention-interval (add_cache_arguments).
    p.add_argument("--prefix-cache-second-hit", action=argparse.BooleanOptionalAction, default=None,
                   help="keep the branch point of a prefix seen a second time (default: on)")
    p.add_argument("--prefix-cache-end-of-generation", action=argparse.BooleanOptionalAction, default=None,
                   help="keep the state at the end of each generation (default: on)")
    p.add_argument("--kv-cache-dtype", default=None)
    add_cache_arguments(p)
    p.add_argument("--tool-call-parser", default=None, help="kimi_k3 | kimi_k2 (default: the model's family)")
    p.add_argument("--reasoning-parser", default=None, help="kimi_k3 | kimi_k2 (default: the model's family)")
    p.add_argument("--chat-encoding", choices=("k3", "k2"), default=None,
                   help="chat format to render and parse (default: the model's family)")
    p.add_argument("--reasoning-content", action="store_true",
                   help="also emit the deprecated `reasoning_content` next to `reasoning`")
    p.add_argument("--max-waiting-requests", type=int, default=None,
                   help="answer 503 + Retry-After while this many requests wait (default: no cap)")
    p.add_argument("--scheduling-policy", choices=("fcfs", "priority"), default=None,
                   help="priority: requests' `priority` field orders the waiting queue")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--disable-log-stats", action="store_true", default=None,
                   help="no periodic stats line (throughput, running and waiting requests, KV cache usage, "
                        "prefix-cache hit rate) in the log; default: every 10 s while busy")


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("serve", help="run the OpenAI-compatible server")
    _add_arguments(p)
    p.set_defaults(func=run_serve)
    return p


def run_serve(args: argparse.Namespace) -> None:
    from hyserve.entrypoints.openai.server import run_server

    args.model = args.model_flag or args.model or DEFAULT_MODEL
    run_server(args)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="hyserve serve")
    _add_arguments(parser)
    run_serve(parser.parse_args(argv))


if __name__ == "__main__":
    main()
