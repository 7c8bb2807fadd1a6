"""`hyserve serve | generate | bench | info`: one entry point; each command lives in its own module."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

# command -> (module, parser-adding function); modules import torch lazily through these
_COMMANDS = {
    "serve": ("hyserve.entrypoints.serve", "add_serve_parser", "run_serve"),
    "generate": ("hyserve.entrypoints.generate", "add_generate_parser", "run_generate"),
    "bench": ("hyserve.bench.cli", "add_bench_parser", None),
    "info": ("hyserve.entrypoints.info", "add_info_parser", "run_info"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hyserve", description="Serve and run Kimi K3-family models.")
    parser.add_argument("--version", action="version", version=_version())
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    sub = parser.add_subparsers(dest="command", metavar="{serve,generate,bench,info}")
    for name, (module, adder, runner) in _COMMANDS.items():
        mod = importlib.import_module(module)
        getattr(mod, adder)(sub)
        if runner and sub.choices[name].get_default("func") is None:
            sub.choices[name].set_defaults(func=getattr(mod, runner))
    return parser


def _version() -> str:
    from hyserve import __version__

    return f"hyserve {__version__}"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(levelname)s %(name)s: %(message)s")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        rc = args.func(args)
    except KeyboardInterrupt:
        return 130
    except (ValueError, KeyError, FileNotFoundError, OSError) as e:
        print(f"hyserve {args.command}: error: {e}", file=sys.stderr)
        return 1
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
