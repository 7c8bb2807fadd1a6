"""`hyserve bench sweep`: the agentic replay at several concurrencies, then the plots."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path

from hyserve.bench.frontier import FloorPoint, frontier_table
from hyserve.bench.metrics import jsonable
from hyserve.bench.plots import plot_latency, plot_pareto
from hyserve.bench.replay import ReplayConfig, format_replay_summary, run_replay


async def run_sweep(base: ReplayConfig, concurrencies: Sequence[int], out_dir: str | Path,
                    floor_of=None) -> list[dict]:
    """One replay per concurrency (sequentially, so runs do not disturb each other); `floor_of(results)`
    gives the floor points of the table and the plot."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for c in concurrencies:
        # salted apart: a point must not hit what an earlier point's same trees left in the server's cache
        result = await run_replay(dataclasses.replace(base, concurrency=int(c), salt_nonce=f"c{c}"))
        (out / f"replay_c{c}.json").write_text(json.dumps(jsonable(result), indent=2))
        print(format_replay_summary(result), flush=True)
        results.append(result)
    write_sweep_outputs(results, out, floor_of(results) if floor_of else ())
    return results


def write_sweep_outputs(results: list[dict], out_dir: str | Path, floor: Sequence[FloorPoint] = ()) -> dict[str, Path]:
    """sweep.json (the results without per-request records), sweep.md (the frontier table), the plots."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summary = out / "sweep.json"
    summary.write_text(
        json.dumps(jsonable([{k: v for k, v in r.items() if k != "requests"} for r in results]), indent=2)
    )
    table = out / "sweep.md"
    table.write_text("\n".join(frontier_table(results, floor)) + "\n")
    return {
        "summary": summary,
        "table": table,
        "pareto": plot_pareto(results, out / "pareto.png", floor=floor),
        "latency": plot_latency(results, out / "latency.png"),
    }
