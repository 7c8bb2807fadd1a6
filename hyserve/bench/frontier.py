"""The frontier of a sweep (`hyserve bench sweep`): the table of each concurrency's point and the floor the
hardware sets for it, from the step cost model (hyserve/planning/step_cost.py).

Concurrency c's floor, from the run's own token mix: decode steps of c sequences, each over the run's mean
context, and the prompt tokens even an ideal prefix cache must compute per output token (prompt tokens per
output token times one minus the theoretical hit rate, over contexts cached to that rate) in chunks of the
step budget the cost model chooses, so prefill is compute-bound and reads the weights once a chunk. The
floor of tok/s/user is one over the decode step (what the ITL of a decode step can be); the floor of
tok/s/GPU counts tokens as `tok_s_per_gpu` does, c·(1 + prompt/output) per c output tokens, over the decode
step plus that share of prefill time. It assumes every lane always has a request running (no think time,
no queueing): a bound, not a prediction.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class FloorPoint:
    concurrency: int
    step_ms: float  # a decode step of c sequences
    cycle_ms: float  # that step plus the prefill its c output tokens bring, at the prefill chunk's cost
    tok_s_per_user: float
    tok_s_per_gpu: float


def floor_points(results: Sequence[dict], model: str, device: str = "H200", weight_bytes: int = 2) -> list[FloorPoint]:
    """The floor of each replay result (`model`: a preset or model directory; `device`: a name
    planning/ceilings.py knows)."""
    from hyserve.entrypoints.info import resolve_config
    from hyserve.planning.ceilings import ceilings_for
    from hyserve.planning.step_budget import choose_step_budget
    from hyserve.planning.step_cost import StepCostModel, StepShape

    ceil = ceilings_for(device)
    if ceil is None:
        raise ValueError(f"no ceilings known for device '{device}'")
    costs = StepCostModel(resolve_config(model), weight_bytes)
    out = []
    for r in sorted(results, key=lambda r: r["concurrency"]):
        c, n = int(r["concurrency"]), max(1, int(r.get("requests_completed") or 0))
        prompt, output = r.get("total_input_tokens") or 0, r.get("total_output_tokens") or 0
        if not output:
            continue
        hit = r.get("prefix_hit_rate_theoretical") or 0.0
        context = round(prompt / n + output / n / 2)
        decode = costs.cost(StepShape(decodes=c, decode_context=context)).floor_s(ceil)
        chunk = choose_step_budget(costs, ceil, c).max_num_batched_tokens
        per_token = costs.cost(StepShape(prefill=chunk, prefill_context=round(prompt / n * hit))).floor_s(ceil) / chunk
        cycle = decode + c * prompt * (1 - hit) / output * per_token  # c output tokens
        out.append(FloorPoint(c, decode * 1e3, cycle * 1e3, 1 / decode, c * (1 + prompt / output) / cycle))
    return out


def _f(v: float | None, spec: str = ".1f") -> str:
    return "n/a" if v is None else format(v, spec)


def frontier_table(results: Sequence[dict], floor: Sequence[FloorPoint] = ()) -> list[str]:
    """Markdown rows: each concurrency's measured point and, with `floor`, its floor and the share reached."""
    by_c = {p.concurrency: p for p in floor}
    head = ("| concurrency | tok/s/user p50 | tok/s/GPU | TTFT p50 (ms) | TTFT p99 (ms) | ITL p50 (ms) | requests | "
            "hit rate (observed / theoretical) |")
    rule = "|---|---|---|---|---|---|---|---|"
    if floor:
        head += " floor decode step (ms) | floor tok/s/user | floor tok/s/GPU | of floor (user / GPU) |"
        rule += "---|---|---|---|"
    rows = [head, rule]
    for r in sorted(results, key=lambda r: r["concurrency"]):
        c, user, gpu = r["concurrency"], r["tok_s_per_user"].get("p50"), r.get("tok_s_per_gpu")
        hits = f"{_f(100 * (r.get('prefix_hit_rate_observed') or 0))}% / {_f(100 * (r.get('prefix_hit_rate_theoretical') or 0))}%"
        row = (f"| {c} | {_f(user)} | {_f(gpu, '.0f')} | {_f(r['ttft_ms'].get('p50'), '.0f')} | "
               f"{_f(r['ttft_ms'].get('p99'), '.0f')} | {_f(r['itl_ms'].get('p50'))} | {r.get('requests_completed', 'n/a')} | "
               f"{hits} |")
        p = by_c.get(c)
        if floor:
            row += (f" {p.step_ms:.1f} | {p.tok_s_per_user:.0f} | {p.tok_s_per_gpu:.0f} | "
                    f"{(user or 0) / p.tok_s_per_user:.0%} / {(gpu or 0) / p.tok_s_per_gpu:.0%} |" if p else " n/a | n/a | n/a | n/a |")
        rows.append(row)
    return rows
