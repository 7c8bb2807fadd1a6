"""Sweep plots: the Pareto curve (tok/s/user vs tok/s/GPU) and latency percentiles vs concurrency."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


def pareto_front(points: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """Points not dominated in (x, y), both higher-is-better, sorted by x ascending."""
    pts = sorted({p for p in points if p[0] is not None and p[1] is not None}, key=lambda p: (-p[0], -p[1]))
    front: list[tuple[float, float]] = []
    best_y = float("-inf")
    for x, y in pts:  # walk from the highest x; keep a point only if it beats every y seen so far
        if y > best_y:
            front.append((x, y))
            best_y = y
    return sorted(front)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # headless: sweeps run on servers without a display
    import matplotlib.pyplot as plt

    return plt


def plot_pareto(results: Sequence[dict], path: str | Path, percentile: str = "p50", floor: Sequence = ()) -> Path:
    """tok/s/user (at `percentile` of ITL) on x, tok/s/GPU on y; each point labelled with its concurrency.
    `floor`: the hardware's point per concurrency (bench/frontier.py FloorPoint), drawn as a line."""
    plt = _pyplot()
    pts = [(r["tok_s_per_user"].get(percentile), r["tok_s_per_gpu"], r["concurrency"]) for r in results]
    fig, ax = plt.subplots(figsize=(7, 5))
    xs = [p[0] for p in pts]
    ys = [p[1] for p in pts]
    ax.scatter(xs, ys, color="tab:blue", zorder=3, label="runs")
    for x, y, c in pts:
        if x is not None:
            ax.annotate(f"c={c}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    front = pareto_front([(x, y) for x, y, _ in pts])
    if front:
        ax.plot([p[0] for p in front], [p[1] for p in front], color="tab:orange", label="Pareto front")
    if floor:
        pts = sorted(floor, key=lambda p: p.concurrency)
        ax.plot([p.tok_s_per_user for p in pts], [p.tok_s_per_gpu for p in pts], color="tab:gray", linestyle="--",
                marker=".", label="floor (step cost model)")
        for p in pts:
            ax.annotate(f"c={p.concurrency}", (p.tok_s_per_user, p.tok_s_per_gpu), textcoords="offset points",
                        xytext=(4, -10), fontsize=7, color="tab:gray")
        ax.set_xscale("log")
        ax.set_yscale("log")
    ax.set_xlabel(f"tok/s/user (1 / ITL {percentile})")
    ax.set_ylabel("tok/s/GPU (input + output)")
    ax.set_title("Interactivity vs throughput")
    ax.grid(True, alpha=0.3)
    ax.legend()
    return _save(plt, fig, path)


def _save(plt, fig, path: str | Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


def plot_latency(
    results: Sequence[dict], path: str | Path, percentiles: Sequence[str] = ("p50", "p90", "p99")
) -> Path:
    """TTFT and ITL percentiles against concurrency, one panel each."""
    plt = _pyplot()
    rs = sorted(results, key=lambda r: r["concurrency"])
    conc = [r["concurrency"] for r in rs]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for ax, key, title in ((axes[0], "ttft_ms", "TTFT (ms)"), (axes[1], "itl_ms", "ITL (ms)")):
        for p in percentiles:
            ax.plot(conc, [r[key].get(p) for r in rs], marker="o", label=p)
        ax.set_title(f"{title.split()[0]} percentiles")
        ax.set_xlabel("concurrency (lanes)")
        ax.set_ylabel(title)
        ax.set_xscale("log", base=2)
        # Label the concurrencies actually run as plain numbers; the log axis would print 2^k.
        ax.set_xticks(conc, [str(c) for c in conc])
        ax.minorticks_off()
        ax.grid(True, alpha=0.3)
        ax.legend()
    return _save(plt, fig, path)
