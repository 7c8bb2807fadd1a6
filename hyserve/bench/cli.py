"""`hyserve bench ...` command line: serve, agentic generate|replay, sweep.

`add_bench_parser(subparsers)` plugs into the main `hyserve` CLI; `python -m hyserve.bench.cli` runs
the same commands standalone. Each handler takes the parsed namespace and returns an exit code.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import sys
from pathlib import Path

import httpx

from hyserve.bench.datasets import DEFAULT_VOCAB_HIGH, DEFAULT_VOCAB_LOW, LENGTH_DISTRIBUTIONS, random_dataset
from hyserve.bench.metrics import jsonable, parse_goodput

DEFAULT_BASE_URL = "http://127.0.0.1:8000"


def _percentiles(text: str) -> tuple[float, ...]:
    try:
        qs = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"bad percentile list {text!r}") from e
    if not qs or any(not 0 <= q <= 100 for q in qs):
        raise argparse.ArgumentTypeError("percentiles must be in [0, 100]")
    return qs


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"bad integer list {text!r}") from e


def _write_json(path: str | None, data: dict | list) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(jsonable(data), indent=2))
        print(f"wrote {path}")


def resolve_model(base_url: str, model: str | None) -> str:
    """`--model` if given, else the first id that GET /v1/models lists."""
    if model:
        return model
    try:
        resp = httpx.get(base_url.rstrip("/") + "/v1/models", timeout=10.0)
        resp.raise_for_status()
        return resp.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
        raise SystemExit(f"--model not given and {base_url}/v1/models did not name one: {e}") from e


# --------------------------------------------------------------------------- serve


def _add_endpoint_args(p: argparse.ArgumentParser, default_endpoint: str = "completions") -> None:
    p.add_argument("--base-url", default=DEFAULT_BASE_URL)
    p.add_argument("--model", default=None, help="served model name (default: first of /v1/models)")
    p.add_argument("--endpoint", choices=("completions", "chat"), default=default_endpoint)
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--vocab-low", type=int, default=DEFAULT_VOCAB_LOW, help="lowest filler token id")
    p.add_argument("--vocab-high", type=int, default=DEFAULT_VOCAB_HIGH, help="highest filler token id")
    p.add_argument("--disable-tqdm", action="store_true")


def _add_serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="synthetic load against an OpenAI-compatible server")
    _add_endpoint_args(p)
    p.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument(
        "--prompt-format",
        choices=("ids", "text"),
        default="ids",
        help="token ids (exact lengths, completions only) or text",
    )
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--length-dist", choices=LENGTH_DISTRIBUTIONS, default="fixed")
    p.add_argument("--range-ratio", type=float, default=0.0, help="uniform: lengths in len*(1±r)")
    p.add_argument("--length-sigma", type=float, default=0.5, help="lognormal shape")
    p.add_argument("--request-rate", type=float, default=math.inf, help="req/s; inf sends all at once")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 = Poisson")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--num-warmups", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--goodput", nargs="+", default=None, metavar="NAME:MS", help="e.g. ttft:500 tpot:50 e2el:5000"
    )
    p.add_argument("--percentiles", type=_percentiles, default=(50.0, 90.0, 99.0), help="e.g. 50,90,99")
    p.add_argument("--result-json", default=None)
    p.add_argument("--save-detailed", action="store_true", help="per-request records in the result JSON")
    p.set_defaults(bench_func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    from hyserve.bench.serve_client import (
        EndpointConfig,
        ServeBenchConfig,
        format_serve_table,
        run_serve_benchmark,
    )

    try:
        slos = parse_goodput(args.goodput)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    model = resolve_model(args.base_url, args.model)
    requests = random_dataset(
        args.num_prompts,
        args.input_len,
        args.output_len,
        dist=args.length_dist,
        range_ratio=args.range_ratio,
        sigma=args.length_sigma,
        vocab_low=args.vocab_low,
        vocab_high=args.vocab_high,
        seed=args.seed,
    )
    endpoint = EndpointConfig(
        base_url=args.base_url,
        model=model,
        endpoint=args.endpoint,
        stream=args.stream,
        ignore_eos=args.ignore_eos,
        prompt_format=args.prompt_format,
        request_timeout_s=args.request_timeout,
    )
    cfg = ServeBenchConfig(
        endpoint=endpoint,
        requests=requests,
        request_rate=args.request_rate,
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        num_warmups=args.num_warmups,
        seed=args.seed,
        percentiles=args.percentiles,
        goodput_slos=slos,
        disable_tqdm=args.disable_tqdm,
    )
    metrics, results = asyncio.run(run_serve_benchmark(cfg))
    print(format_serve_table(metrics, args.percentiles))
    out = {
        "config": {k: v for k, v in vars(args).items() if not callable(v)}
        | {"model": model, "request_rate": str(args.request_rate)},
        **metrics,
    }
    if args.save_detailed:
        out["requests"] = [
            {
                "success": r.success,
                "prompt_len": r.prompt_len,
                "output_len": r.output_len,
                "ttft": r.ttft,
                "latency": r.latency,
                "itl": r.itl,
                "cached_tokens": r.cached_tokens,
                "error": r.error or None,
            }
            for r in results
        ]
    _write_json(args.result_json, out)
    return 0 if metrics["completed"] else 1


# --------------------------------------------------------------------------- agentic


def _add_generate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="write synthetic agentic traces (cc-traces JSON shape)")
    p.add_argument("--sessions", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="synthetic-agent", help="model name recorded in the traces")
    p.add_argument(
        "--context-scale", type=float, default=1.0, help="scale all context sizes (<1 for small models)"
    )
    p.add_argument("--output-scale", type=float, default=1.0)
    p.add_argument("--harness-fraction", type=float, default=0.5)
    p.add_argument("--turns-min", type=int, default=20)
    p.add_argument("--turns-max", type=int, default=2000)
    p.add_argument("--p-tool-use", type=float, default=0.85)
    p.add_argument("--p-subagent", type=float, default=0.03)
    p.add_argument("--max-fanout", type=int, default=4)
    p.add_argument("--p-compact", type=float, default=0.005)
    p.add_argument("--stats-json", default=None)
    p.set_defaults(bench_func=cmd_generate)


def cmd_generate(args: argparse.Namespace) -> int:
    from hyserve.bench.traces import GeneratorConfig, format_stats, generate_traces, save_traces, trace_stats

    cfg = GeneratorConfig(
        sessions=args.sessions,
        seed=args.seed,
        model=args.model,
        context_scale=args.context_scale,
        output_scale=args.output_scale,
        harness_fraction=args.harness_fraction,
        turns_min=args.turns_min,
        turns_max=args.turns_max,
        p_tool_use=args.p_tool_use,
        p_subagent=args.p_subagent,
        max_fanout=args.max_fanout,
        p_compact=args.p_compact,
    )
    traces, gen = generate_traces(cfg)
    save_traces(traces, args.out)
    stats = trace_stats(traces)
    stats["modes"] = gen["modes"]
    stats["compactions"] = gen["compactions"]
    print(format_stats(stats))
    print(f"wrote {len(traces)} traces to {args.out}")
    _write_json(args.stats_json, stats | {"config": gen["config"]})
    return 0


def _add_replay_args(p: argparse.ArgumentParser, traces_required: bool = True) -> None:
    _add_endpoint_args(p)
    p.add_argument("--traces", required=traces_required, help="cc-traces JSON / JSONL (real or synthetic)")
    p.add_argument("--max-traces", type=int, default=None, help="use only the first N traces")
    p.add_argument("--duration", type=float, default=1800.0, help="seconds of replay")
    p.add_argument(
        "--time-scale", type=float, default=1.0, help="multiply think times (e.g. 0.01 for CPU runs)"
    )
    p.add_argument(
        "--idle-cap", type=float, default=10.0, help="cap (s) on a think gap with nothing in flight"
    )
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--warmup-barrier", action=argparse.BooleanOptionalAction, default=False,
                   help="start the window once every lane's warm-up has landed (short runs measure warm sessions)")
    p.add_argument(
        "--max-input-len", type=int, default=None, help="truncate prompts (keeps the leading blocks)"
    )
    p.add_argument("--max-output-len", type=int, default=None)
    p.add_argument("--salt-tokens", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument(
        "--cache-salt",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="send the per-tree salt as the `cache_salt` field",
    )
    p.add_argument("--num-gpus", type=int, default=1, help="TP*PP*PCP (or prefill+decode GPUs)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--grace", type=float, default=0.0, help="seconds in-flight requests may finish after --duration"
    )
    p.add_argument("--percentiles", type=_percentiles, default=(50.0, 90.0, 99.0))


def _replay_config(args: argparse.Namespace, concurrency: int):
    from hyserve.bench.replay import ReplayConfig
    from hyserve.bench.serve_client import EndpointConfig
    from hyserve.bench.traces import load_traces

    traces = load_traces(args.traces)[: args.max_traces]
    endpoint = EndpointConfig(
        base_url=args.base_url,
        model=resolve_model(args.base_url, args.model),
        endpoint=args.endpoint,
        stream=True,
        ignore_eos=True,
        prompt_format="ids",
        request_timeout_s=args.request_timeout,
    )
    return ReplayConfig(
        traces=traces,
        endpoint=endpoint,
        concurrency=concurrency,
        duration_s=args.duration,
        time_scale=args.time_scale,
        idle_cap_s=args.idle_cap,
        warmup=args.warmup,
        warmup_barrier=args.warmup_barrier,
        vocab_low=args.vocab_low,
        vocab_high=args.vocab_high,
        max_input_len=args.max_input_len,
        max_output_len=args.max_output_len,
        salt_tokens=args.salt_tokens,
        cache_salt_field=args.cache_salt,
        num_gpus=args.num_gpus,
        seed=args.seed,
        grace_s=args.grace,
        percentiles=args.percentiles,
        disable_tqdm=args.disable_tqdm,
        keep_requests=getattr(args, "save_requests", False),
    )


def _add_replay_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("replay", help="replay agentic traces against a server")
    _add_replay_args(p)
    p.add_argument("--concurrency", type=int, default=1, help="live trajectory trees (lanes)")
    p.add_argument("--result-json", default=None)
    p.add_argument("--save-requests", action="store_true", help="per-request records in the result JSON")
    p.set_defaults(bench_func=cmd_replay)


def cmd_replay(args: argparse.Namespace) -> int:
    from hyserve.bench.replay import format_replay_summary, run_replay

    result = asyncio.run(run_replay(_replay_config(args, args.concurrency)))
    print(format_replay_summary(result))
    _write_json(args.result_json, result)
    return 0 if result["requests_completed"] else 1


def _add_sweep_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sweep", help="replay at several concurrencies and plot the Pareto curve")
    p.add_argument(
        "--from-results",
        nargs="+",
        default=None,
        help="only plot these replay result JSONs (no server needed)",
    )
    p.add_argument("--concurrencies", type=_int_list, default=[1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--out-dir", default="bench_sweep")
    p.add_argument("--floor-model", default=None,
                   help="preset or model directory whose step cost model draws the floor line (e.g. kimi-linear-48b-a3b)")
    p.add_argument("--floor-device", default="H200", help="the device whose ceilings the floor uses")
    _add_replay_args(p, traces_required=False)
    p.set_defaults(bench_func=cmd_sweep)


def cmd_sweep(args: argparse.Namespace) -> int:
    from hyserve.bench.frontier import floor_points
    from hyserve.bench.sweep import run_sweep, write_sweep_outputs

    def floor_of(results: list[dict]) -> list:
        return floor_points(results, args.floor_model, args.floor_device) if args.floor_model else []

    if args.floor_model:
        from hyserve.planning.ceilings import KNOWN, ceilings_for

        if ceilings_for(args.floor_device) is None:
            print(f"error: no ceilings known for --floor-device {args.floor_device!r} "
                  f"(known: {', '.join(k for k, _ in KNOWN)})", file=sys.stderr)
            return 2
    if args.from_results:
        results = [json.loads(Path(f).read_text()) for f in args.from_results]
        paths = write_sweep_outputs(results, args.out_dir, floor_of(results))
    else:
        if not args.traces:
            print("error: --traces is required unless --from-results is given", file=sys.stderr)
            return 2
        base = _replay_config(args, 1)
        results = asyncio.run(run_sweep(base, args.concurrencies, args.out_dir, floor_of))
        paths = {
            k: Path(args.out_dir) / f
            for k, f in (("summary", "sweep.json"), ("table", "sweep.md"), ("pareto", "pareto.png"),
                         ("latency", "latency.png"))
        }
    print(Path(args.out_dir, "sweep.md").read_text())
    for name, path in paths.items():
        print(f"{name}: {path}")
    return 0


# --------------------------------------------------------------------------- wiring


def add_bench_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add `bench` (serve, agentic generate|replay, sweep) to a CLI's subparsers."""
    bench = subparsers.add_parser("bench", help="serving benchmarks")
    sub = bench.add_subparsers(dest="bench_command", required=True)
    _add_serve_parser(sub)
    agentic = sub.add_parser("agentic", help="agentic traces: generate or replay")
    asub = agentic.add_subparsers(dest="agentic_command", required=True)
    _add_generate_parser(asub)
    _add_replay_parser(asub)
    _add_sweep_parser(sub)
    bench.set_defaults(func=run_bench)
    return bench


def run_bench(args: argparse.Namespace) -> int:
    """Dispatch a parsed `bench ...` namespace to its handler."""
    # httpx logs every request at INFO; under `hyserve --log-level INFO` that buries the summary tables.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))
    return int(args.bench_func(args) or 0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hyserve.bench.cli")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    argv = list(sys.argv[1:] if argv is None else argv)
    # Standalone use may omit the leading `bench`.
    if not argv or argv[0] != "bench":
        argv = ["bench", *argv]
    args = parser.parse_args(argv)
    return run_bench(args)


if __name__ == "__main__":
    sys.exit(main())
