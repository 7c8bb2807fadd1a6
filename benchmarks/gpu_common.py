# ruff: noqa: B023  (timing lambdas run inside the loop that binds them)
"""Shared pieces of the GPU benchmarks: ceilings measured in the same run, timing, a filled cache, and the
markdown report (filed under "Current results" in docs/BENCHMARKS.md, appended to $OUT when set). Models come
from the product loader (`load_model`, as `LLM(...)` and `hyserve serve` build them), engines from `LLM(...)`."""

from __future__ import annotations

import os
import statistics
import sys
from pathlib import Path

import torch
from results_doc import add_section

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DATE = "2026-11-30"


def time_ms(fn, warmup: int = 2, iters: int = 10) -> float:
    """Median of CUDA-event timings of fn() after warm-up."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def capture_graph(fn) -> torch.cuda.CUDAGraph:
    """fn() captured in a CUDA graph, after two eager runs (compiles, lazy buffers) the second on a side
    stream, as torch.cuda.graph expects."""
    fn()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def time_graph_ms(fn, iters: int = 10) -> float:
    """Median GPU time of fn() replayed from a CUDA graph: no host launch cost, as decode steps run."""
    return time_ms(capture_graph(fn).replay, 2, iters)


def time_graph_per_call_ms(fn, calls: int = 8, iters: int = 10) -> float:
    """GPU time per call of fn() inside a graph of `calls` back-to-back calls, as a decode step's graph runs
    one kernel after another layer's: a single-call graph also times the replay's own launch latency
    (several µs, a tenth of a 90 µs kernel). Calls reuse their inputs, so data under the 50 MB L2 stays
    cached across them."""
    return time_graph_ms(lambda: [fn() for _ in range(calls)], iters) / calls


def ceilings() -> dict[str, float]:
    """Device-to-device copy bandwidth (read + write, 1 GiB) and bf16 matmul rate (8192³), random data."""
    src = torch.randn(1 << 29, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), 3, 20)
    bw = 2 * src.numel() * 2 / ms / 1e9  # TB/s
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = time_ms(lambda: a @ b, 3, 20)
    return {"copy_tbs": bw, "mm_tflops": 2 * 8192**3 / ms / 1e9}


def machine() -> str:
    p = torch.cuda.get_device_properties(0)
    return f"{p.name}, {p.multi_processor_count} SMs, torch {torch.__version__}"


# the preset: the real shape, random bf16 weights drawn on the GPU; loaded with the product loader
# (`load_model(MODEL_48B, device="cuda")`), as `hyserve serve kimi-linear-48b-a3b` loads it
MODEL_48B = "kimi-linear-48b-a3b"


def fill_cache_(cache, gen: torch.Generator) -> None:
    """Random, non-zero cache contents (zeros can run faster than real data: METHOD.md)."""
    cache.pages.normal_(0, 1, generator=gen)
    cache.conv.normal_(0, 0.5, generator=gen)
    cache.recurrent.normal_(0, 0.02, generator=gen)


def active_bytes(cfg, tokens: int) -> dict[str, float]:
    """Weight bytes a step of `tokens` tokens must read (bf16): everything but the embedding table and the
    routed experts, plus the expected number of distinct routed experts per MoE layer (uniform routing)."""
    d, p, h, k = cfg.hidden_size, cfg.kda_proj_dim, cfg.kda_num_heads, cfg.kda_head_dim
    kda = 3 * p * d + k * d + p * k + h * d + k * d + p * k + p * d
    mla = cfg.num_attention_heads * cfg.qk_head_dim * d + cfg.kv_row_width * d
    mla += cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim) * cfg.kv_lora_rank
    mla += d * cfg.num_attention_heads * cfg.v_head_dim
    n_moe = sum(1 for t in cfg.mlp_types if t == "moe")
    n_dense = len(cfg.mlp_types) - n_moe
    expert = 3 * d * cfg.moe_intermediate_size
    e, ke = cfg.num_experts, cfg.num_experts_per_tok
    distinct = e * (1 - (1 - ke / e) ** tokens)
    params = (len(cfg.kda_layers) * kda + len(cfg.mla_layers) * mla + n_dense * 3 * d * cfg.intermediate_size
              + n_moe * (expert * cfg.num_shared_experts + e * d * 2) + cfg.vocab_size * d)
    return {"dense": 2.0 * params, "experts": 2.0 * n_moe * distinct * expert}


def active_params_per_token(cfg) -> float:
    """Multiply-adds per token in the GEMMs (no embedding), i.e. FLOPs / 2."""
    b = active_bytes(cfg, 1)
    d = cfg.hidden_size
    n_moe = sum(1 for t in cfg.mlp_types if t == "moe")
    per_expert = 3 * d * cfg.moe_intermediate_size
    return b["dense"] / 2 + n_moe * cfg.num_experts_per_tok * per_expert


def report(title: str, command: str, table: list[str], notes: list[str], out_name: str, date: str = DATE) -> None:
    text = "\n".join([f"\n## {title} ({date})", "", f"Machine: {machine()}. Command: `{command}`.", "", *table,
                      "", *notes, ""])
    print(text)
    add_section(ROOT / "docs" / "BENCHMARKS.md", text)
    if os.environ.get("OUT"):
        target = Path(os.environ["OUT"]) / out_name
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target, "a") as fh:
            fh.write(text)


def print_or_report(script: str, argv: list[str] | None, title: str, table: list[str], notes: list[str],
                    out_name: str, print_only: bool) -> None:
    """The table printed (`print_only`: a dry run or --no-append), or `report`ed with the command line."""
    if print_only:
        print("\n".join(table + [""] + notes))
        return
    command = " ".join([f"python benchmarks/{script}", *(sys.argv[1:] if argv is None else argv)])
    report(title, command, table, notes, out_name)
