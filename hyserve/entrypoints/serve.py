"""`hyserve serve [MODEL]`: flags follow `vllm serve`; the engine flags come from `EngineConfig`
(docs/ARCHITECTURE.md §6). Runnable as a module for tests:
`python -m hyserve.entrypoints.serve k3-tiny --port 8000`."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from hyserve import envs
from hyserve.config import DEFAULT_MODEL
from hyserve.entrypoints.engine_args import add_engine_arguments

# EngineConfig fields without an engine flag here: the model is the positional MODEL (or --model)
SERVE_EXCLUDED = frozenset({"model"})


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None, help=f"model directory or preset (default: {DEFAULT_MODEL})")
    p.add_argument("--model", dest="model_flag", default=None, help="same as the positional MODEL")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` on /v1 endpoints")
    p.add_argument("--tool-call-parser", default=None, help="kimi_k3 | kimi_k2 (default: the model's family)")
    p.add_argument("--reasoning-parser", default=None, help="kimi_k3 | kimi_k2 (default: the model's family)")
    p.add_argument("--chat-encoding", choices=("k3", "k2"), default=None,
                   help="chat format to render and parse (default: the model's family)")
    p.add_argument("--reasoning-content", action="store_true",
                   help="also emit the deprecated `reasoning_content` next to `reasoning`")
    p.add_argument("--max-waiting-requests", type=int, default=None,
                   help="answer 503 + Retry-After while this many requests wait (default: no cap)")
    p.add_argument("--responses-store-size", type=_positive(int), default=None, metavar="N",
                   help="Responses API: keep the N most recently used responses for previous_response_id "
                        f"(default: env HYSERVE_RESPONSES_STORE_SIZE, else {envs.DEFAULT_RESPONSES_STORE_SIZE})")
    p.add_argument("--responses-store-mib", type=_positive(float), default=None, metavar="MIB",
                   help="Responses API: and at most MIB MiB of them, as JSON (default: env "
                        f"HYSERVE_RESPONSES_STORE_MIB, else {envs.DEFAULT_RESPONSES_STORE_MIB})")
    add_engine_arguments(p.add_argument_group("engine"), exclude=SERVE_EXCLUDED)


def _positive(kind: type) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            value = 0
        if not 0 < value < float("inf"):
            raise argparse.ArgumentTypeError(f"must be a {'whole ' if kind is int else ''}number > 0, got {text!r}")
        return value

    return parse


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
