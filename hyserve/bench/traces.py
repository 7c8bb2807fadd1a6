"""Agentic traces: the Weka cc-traces JSON shape, the synthetic generator, and trace statistics.

A trace is a plain dict exactly as in `semianalysisai/cc-traces-weka-*` (docs/ARCHITECTURE.md §9): `id`, `models`,
`block_size`, `hash_id_scope`, `tool_tokens`, `system_tokens`, `requests[]`; a request carries `t`,
`type`, `model`, `in`, `out`, `hash_ids`, `input_types`, `output_types`, `stop`, `api_time`,
`think_time`; a `type: "subagent"` entry nests `agent_id`, `subagent_type`, `status`, `models` and its
own `requests`. Keeping dicts (not classes) means real and synthetic files go through one replayer.

Synthetic files use `hash_id_scope: "global"`: ids are unique across the whole file, and the
system-prompt and tool-definition blocks reuse the same ids in every session of the same harness, so
cross-session sharing is visible to both the replayer and the statistics. Real files are `"local"`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np


@dataclass
class GeneratorConfig:
    sessions: int = 16
    seed: int = 0
    model: str = "synthetic-agent"
    block_size: int = 64
    # Multiplies every context size (prefixes, growth, compaction limits); <1 makes small-model traces.
    context_scale: float = 1.0
    # Multiplies output lengths.
    output_scale: float = 1.0
    harness_fraction: float = 0.5
    # bare: a short prompt (small shared system prompt + user message).
    bare_prefix_median: int = 500
    bare_system_tokens: int = 256
    # harness: shared system prompt + shared tool definitions + per-session project context.
    harness_prefix_median: int = 70_000
    harness_prefix_sigma: float = 0.25
    harness_prefix_min: int = 40_000
    harness_prefix_max: int = 120_000
    num_system_variants: int = 2
    harness_system_tokens: int = 3_072
    num_tool_variants: int = 3
    tool_tokens_min: int = 8_192
    tool_tokens_max: int = 24_576
    # Turns per trace: 20 * (1 + Pareto(alpha)), clipped; heavy-tailed with a median around 35.
    turns_min: int = 20
    turns_max: int = 2_000
    turns_alpha: float = 1.1
    out_median: float = 60.0
    out_sigma: float = 1.2
    out_max: int = 8_000
    # Tool-result growth per turn: log-normal body, Pareto tail with probability growth_tail_prob.
    growth_median: float = 400.0
    growth_sigma: float = 1.0
    growth_tail_prob: float = 0.05
    growth_tail_alpha: float = 1.5
    growth_tail_scale: float = 4_000.0
    growth_max: int = 60_000
    p_tool_use: float = 0.85
    tool_think_median_s: float = 1.0
    tool_think_sigma: float = 0.8
    human_think_median_s: float = 20.0
    human_think_sigma: float = 1.2
    p_compact: float = 0.005
    compact_at_tokens: int = 160_000
    compact_summary_median: int = 3_000
    max_input_tokens: int = 990_000
    p_subagent: float = 0.03
    max_fanout: int = 4
    subagent_turns_min: int = 3
    subagent_turns_max: int = 15
    subagent_prefix_median: int = 6_000


class _Ids:
    """File-wide hash-id counter (synthetic files use global scope)."""

    def __init__(self) -> None:
        self.next = 0

    def fresh(self, n: int) -> list[int]:
        out = list(range(self.next, self.next + n))
        self.next += n
        return out


def _blocks(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


class _Generator:
    def __init__(self, cfg: GeneratorConfig) -> None:
        self.cfg = cfg
        self.ids = _Ids()
        self.shared: dict[tuple, list[int]] = {}
        rng = np.random.default_rng([cfg.seed, 0xB10C])
        bs = cfg.block_size
        # Shared prefix sizes are whole blocks so every shared block is full (and cacheable).
        self.harness_system = self._round_blocks(cfg.harness_system_tokens)
        self.bare_system = self._round_blocks(cfg.bare_system_tokens)
        lo, hi = (self._round_blocks(cfg.tool_tokens_min), self._round_blocks(cfg.tool_tokens_max))
        self.tool_sizes = [
            int(rng.integers(lo // bs, hi // bs + 1)) * bs for _ in range(cfg.num_tool_variants)
        ]

    def _scaled(self, tokens: float) -> int:
        return max(1, int(round(tokens * self.cfg.context_scale)))

    def _round_blocks(self, tokens: float) -> int:
        bs = self.cfg.block_size
        return max(bs, int(round(tokens * self.cfg.context_scale / bs)) * bs)

    def _shared_ids(self, key: tuple, n_blocks: int) -> list[int]:
        # Tool blocks are keyed by (system, tools): ids are prefix-chained, like a real prefix cache.
        if key not in self.shared:
            self.shared[key] = self.ids.fresh(n_blocks)
        return self.shared[key]

    def _out_len(self, rng: np.random.Generator) -> int:
        c = self.cfg
        v = rng.lognormal(math.log(c.out_median * c.output_scale), c.out_sigma)
        return int(np.clip(round(v), 1, max(1, c.out_max * c.output_scale)))

    def _growth(self, rng: np.random.Generator) -> int:
        c = self.cfg
        if rng.random() < c.growth_tail_prob:
            v = c.growth_tail_scale * (1.0 + rng.pareto(c.growth_tail_alpha))
        else:
            v = rng.lognormal(math.log(c.growth_median), c.growth_sigma)
        return min(self._scaled(v), self._scaled(c.growth_max))

    def _think(self, rng: np.random.Generator, after_stop: str) -> float:
        c = self.cfg
        if after_stop == "tool_use":
            return float(rng.lognormal(math.log(c.tool_think_median_s), c.tool_think_sigma))
        return float(rng.lognormal(math.log(c.human_think_median_s), c.human_think_sigma))

    @staticmethod
    def _api_time(new_tokens: int, out: int) -> float:
        # A plausible service time (prefill of uncached tokens + decode); only used for `t` bookkeeping.
        return round(0.2 + 2e-5 * new_tokens + 0.02 * out, 3)

    def _conversation(
        self,
        rng: np.random.Generator,
        t0: float,
        n_turns: int,
        shared_ids: list[int],
        shared_tokens: int,
        first_in: int,
        allow_subagents: bool,
        stats: dict,
    ) -> tuple[list[dict], float]:
        """One agent's growing conversation; returns (requests, end time)."""
        c, bs = self.cfg, self.cfg.block_size
        cur_in = first_in
        hash_ids = shared_ids + self.ids.fresh(_blocks(cur_in - shared_tokens, bs))
        reqs: list[dict] = []
        t, think, in_type, new_tokens = t0, 0.0, "text", cur_in
        max_in, compact_at = self._scaled(c.max_input_tokens), self._scaled(c.compact_at_tokens)
        for k in range(n_turns):
            out = self._out_len(rng)
            stop = "tool_use" if (k < n_turns - 1 and rng.random() < c.p_tool_use) else "end_turn"
            api = self._api_time(new_tokens, out)
            reqs.append(
                {
                    "t": round(t, 3),
                    "type": "n",
                    "model": c.model,
                    "in": cur_in,
                    "out": out,
                    "hash_ids": list(hash_ids),
                    "input_types": [in_type],
                    "output_types": ["text", "tool_use"] if stop == "tool_use" else ["text"],
                    "stop": stop,
                    "api_time": api,
                    "think_time": round(think, 3),
                }
            )
            t_end = t + api
            growth = self._growth(rng)
            if allow_subagents and stop == "tool_use" and rng.random() < c.p_subagent:
                group, t_join, result_tokens = self._subagents(rng, t_end, stats)
                reqs.extend(group)
                t_end = max(t_end, t_join)
                growth += result_tokens
            think = self._think(rng, stop)
            t = t_end + think
            in_type = "tool_result" if stop == "tool_use" else "text"
            next_in = cur_in + out + growth
            if next_in > max_in or next_in > compact_at or rng.random() < c.p_compact:
                # Compaction: the shared system/tool prefix survives, the conversation restarts fresh.
                summary = self._scaled(rng.lognormal(math.log(c.compact_summary_median), 0.5))
                next_in = shared_tokens + summary
                hash_ids = shared_ids + self.ids.fresh(_blocks(summary, bs))
                new_tokens = summary
                stats["compactions"] += 1
            else:
                keep = cur_in // bs  # the trailing partial block is never reused
                hash_ids = hash_ids[:keep] + self.ids.fresh(_blocks(next_in, bs) - keep)
                new_tokens = next_in - keep * bs
            cur_in = next_in
        return reqs, t_end

    def _subagents(
        self, rng: np.random.Generator, t_spawn: float, stats: dict
    ) -> tuple[list[dict], float, int]:
        c = self.cfg
        k = int(rng.integers(1, c.max_fanout + 1))
        stats["fanouts"].append(k)
        group, t_join, result_tokens = [], t_spawn, 0
        for _ in range(k):
            turns = int(rng.integers(c.subagent_turns_min, c.subagent_turns_max + 1))
            prefix = self._scaled(rng.lognormal(math.log(c.subagent_prefix_median), 0.5))
            reqs, t_end = self._conversation(rng, t_spawn, turns, [], 0, prefix, False, stats)
            t_join = max(t_join, t_end)
            result_tokens += reqs[-1]["out"]
            group.append(
                {
                    "t": round(t_spawn, 3),
                    "type": "subagent",
                    "agent_id": f"agent-{rng.bytes(6).hex()}",
                    "subagent_type": str(rng.choice(["general-purpose", "Explore", "Plan"])),
                    "status": "completed",
                    "models": [c.model],
                    "requests": reqs,
                }
            )
        return group, t_join, result_tokens

    def trace(self, index: int, stats: dict) -> dict:
        c = self.cfg
        rng = np.random.default_rng([c.seed, index])
        harness = rng.random() < c.harness_fraction
        if harness:
            sv = int(rng.integers(c.num_system_variants))
            tv = int(rng.integers(c.num_tool_variants))
            system_tokens, tool_tokens = self.harness_system, self.tool_sizes[tv]
            shared_ids = self._shared_ids(("harness-system", sv), system_tokens // c.block_size)
            shared_ids = shared_ids + self._shared_ids(("harness-tools", sv, tv), tool_tokens // c.block_size)
            total = rng.lognormal(math.log(c.harness_prefix_median), c.harness_prefix_sigma)
            total = self._scaled(np.clip(total, c.harness_prefix_min, c.harness_prefix_max))
        else:
            system_tokens, tool_tokens = self.bare_system, 0
            shared_ids = self._shared_ids(("bare-system",), system_tokens // c.block_size)
            total = self._scaled(max(1.0, rng.normal(c.bare_prefix_median, 0.12 * c.bare_prefix_median)))
        shared_tokens = system_tokens + tool_tokens
        first_in = max(total, shared_tokens + 1)
        n_turns = int(np.clip(round(c.turns_min * (1 + rng.pareto(c.turns_alpha))), c.turns_min, c.turns_max))
        stats["modes"]["harness" if harness else "bare"] += 1
        reqs, _ = self._conversation(rng, 0.0, n_turns, shared_ids, shared_tokens, first_in, True, stats)
        return {
            "id": rng.bytes(18).hex(),
            "models": [c.model],
            "block_size": c.block_size,
            "hash_id_scope": "global",
            "tool_tokens": tool_tokens,
            "system_tokens": system_tokens,
            "requests": reqs,
        }


def generate_traces(cfg: GeneratorConfig) -> tuple[list[dict], dict]:
    """Generate `cfg.sessions` traces; also returns generator-side counts (modes, compactions, fan-outs)."""
    gen = _Generator(cfg)
    stats: dict = {"modes": {"bare": 0, "harness": 0}, "compactions": 0, "fanouts": [], "config": asdict(cfg)}
    return [gen.trace(i, stats) for i in range(cfg.sessions)], stats


# --------------------------------------------------------------------------- reading and statistics


def load_traces(path: str | Path) -> list[dict]:
    """Read a JSON list, `{"traces": [...]}`, one trace object, or JSON Lines."""
    text = Path(path).read_text()
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        data = [json.loads(line) for line in text.splitlines() if line.strip()]
    if isinstance(data, dict):
        data = data.get("traces", [data])
    if not all(isinstance(t, dict) and "requests" in t for t in data):
        raise ValueError(f"{path}: not a cc-traces file (every trace needs a `requests` list)")
    return data


def save_traces(traces: list[dict], path: str | Path) -> None:
    Path(path).write_text(json.dumps(traces, separators=(",", ":")))


def iter_requests(trace: dict) -> Iterator[tuple[dict, bool]]:
    """Every leaf request in recorded order, flagged True when it belongs to a subagent."""

    def walk(reqs: list[dict], sub: bool) -> Iterator[tuple[dict, bool]]:
        for r in reqs:
            if r.get("type") == "subagent":
                yield from walk(r.get("requests", []), True)
            else:
                yield r, sub

    yield from walk(trace.get("requests", []), False)


def hit_tokens(in_tokens: int, hash_ids: list[int], seen: set, block_size: int) -> int:
    """Tokens an ideal prefix cache could skip: the leading run of already-seen *full* blocks.

    Only a leading run counts because a prefix cache cannot reuse a block after a miss, and a partial
    block is never cached.
    """
    hit = 0
    for i, h in enumerate(hash_ids):
        size = min(block_size, in_tokens - i * block_size)
        if size < block_size or h not in seen:
            break
        hit += size
    return hit


def theoretical_hit_rate(traces: list[dict], scope: str = "trace") -> float:
    """Σ hit tokens / Σ ISL over all requests; `scope="file"` lets blocks seen in earlier traces count
    (meaningful only for global-scope files, where ids are comparable across traces)."""
    total_hit = total_in = 0
    seen_file: set = set()
    for trace in traces:
        bs = int(trace.get("block_size", 64))
        seen = seen_file if scope == "file" else set()
        for r, _ in iter_requests(trace):
            total_hit += hit_tokens(int(r["in"]), r["hash_ids"], seen, bs)
            total_in += int(r["in"])
            seen.update(r["hash_ids"])
    return total_hit / total_in if total_in else 0.0


def _max_in_flight(trace: dict) -> int:
    events = []
    for r, _ in iter_requests(trace):
        t = float(r.get("t", 0.0))
        events += [(t, 1), (t + float(r.get("api_time", 0.0)), -1)]
    cur = best = 0
    for _, d in sorted(events, key=lambda e: (e[0], e[1])):
        cur += d
        best = max(best, cur)
    return best


def _pcts(values: list[float]) -> dict:
    if not values:
        return {}
    a = np.asarray(values, dtype=np.float64)
    return {
        "mean": float(a.mean()),
        **{f"p{q}": float(np.percentile(a, q)) for q in (10, 50, 90, 99)},
        "max": float(a.max()),
    }


def trace_stats(traces: list[dict]) -> dict:
    """Calibration statistics (docs/ARCHITECTURE.md §9, the synthetic generator)."""
    isl, osl, think_tool, think_human, turns, fanouts, in_flight = [], [], [], [], [], [], []
    top = sub = 0
    for trace in traces:
        prev_stop = None
        n_top = 0
        for r in trace["requests"]:
            if r.get("type") == "subagent":
                continue
            n_top += 1
            if prev_stop is not None:
                (think_tool if prev_stop == "tool_use" else think_human).append(
                    float(r.get("think_time", 0.0))
                )
            prev_stop = r.get("stop")
        turns.append(n_top)
        # Consecutive subagent entries are one concurrent fan-out.
        run = 0
        for r in trace["requests"] + [{}]:
            if r.get("type") == "subagent":
                run += 1
            elif run:
                fanouts.append(run)
                run = 0
        for r, is_sub in iter_requests(trace):
            isl.append(int(r["in"]))
            osl.append(int(r["out"]))
            sub += is_sub
            top += not is_sub
        in_flight.append(_max_in_flight(trace))
    return {
        "traces": len(traces),
        "requests_top_level": top,
        "requests_subagent": sub,
        "turns_per_trace": _pcts(turns),
        "isl": _pcts(isl),
        "osl": _pcts(osl),
        "think_time_after_tool_use_s": _pcts(think_tool),
        "think_time_after_end_turn_s": _pcts(think_human),
        "fanout": {"groups": len(fanouts), **_pcts(fanouts)},
        "max_in_flight_per_trace": _pcts(in_flight),
        "theoretical_hit_rate": theoretical_hit_rate(traces, "trace"),
        "theoretical_hit_rate_cross_trace": (
            theoretical_hit_rate(traces, "file")
            if all(t.get("hash_id_scope") == "global" for t in traces)
            else None
        ),
    }


def format_stats(stats: dict) -> str:
    lines = []
    for key, value in stats.items():
        if isinstance(value, dict):
            inner = "  ".join(
                f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in value.items()
            )
            lines.append(f"{key:<36}{inner}")
        elif isinstance(value, float):
            lines.append(f"{key:<36}{value:.4f}")
        else:
            lines.append(f"{key:<36}{value}")
    return "\n".join(lines)
