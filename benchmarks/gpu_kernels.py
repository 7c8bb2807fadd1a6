# ruff: noqa: B023  (timing lambdas run inside the loop that binds them)
"""Kernel micro-benchmarks with their own floors: fused KDA decode, one token and T tokens per sequence
(state bytes vs copy bandwidth), paged MLA decode (cache rows vs copy bandwidth), MLA prefill of a chunk
over a cached context (one lower-right SDPA call vs the cuDNN split; FLOPs vs matmul rate), grouped MoE
(distinct expert weights vs bandwidth, FLOPs vs matmul rate).

    python benchmarks/gpu_kernels.py                 # every section
    python benchmarks/gpu_kernels.py --only kda,moe  # some of kda, kda_prefill, kda_multi, mla, mla_prefill, moe

KDA decode, MLA decode and MoE are timed as CUDA-graph replays, as decode steps run them (a timed eager
call also counts the host's launch path, which is most of it at batch 1). MLA decode is timed with L2
flushed before each replay and sweeps the kernel's knobs (MLA_SWEEP; HYSERVE_BENCH_QUICK=1 runs eight
configs on three shapes); it prints the best config per shape."""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from gpu_common import capture_graph, ceilings, report, time_graph_ms, time_graph_per_call_ms, time_ms

from hyserve.models.layers.activation import GLU
from hyserve.models.layers.norm import gated_rms_norm
from hyserve.ops import moe as moe_ref
from hyserve.ops.kda_conv import causal_conv_varlen_triton
from hyserve.ops.kda_decode import kda_decode, kda_decode_multi
from hyserve.ops.kda_out_norm import gated_rms_norm_rows
from hyserve.ops.kda_prefill import causal_conv_varlen
from hyserve.ops.mla_decode import mla_absorbed_decode_fast, mla_decode_latent, plan_splits
from hyserve.ops.moe_gemv import experts_forward_gemv
from hyserve.ops.moe_grouped import experts_forward_grouped
from hyserve.ops.moe_triton import experts_forward_triton

QUICK = os.environ.get("HYSERVE_BENCH_QUICK") == "1"  # a smaller sweep for short device calls


def kda_rows(ceil, gen) -> list[str]:
    """One token per sequence: the default path (output norm in the state kernel's last arrival per head,
    two launches) swept over its block configs, and next to it the former three launches (a separate
    finish kernel) at the same best config and at the default one; in the note, PDL. Per call in a graph
    of 8 calls, as the engine's step graph runs 20 KDA layers (batch 1's 2 MB of state stays in L2 across
    the calls)."""
    h, k, w = 32, 128, 4
    p = h * k
    rows = []
    for n in (1, 64, 256):
        args = (*_kda_inputs(n, 1, h, k, w, gen), k**-0.5, 1e-5, None)
        best = None
        default = time_graph_per_call_ms(lambda: kda_decode(*args, fused_finish=True, pdl=False))
        default3 = time_graph_per_call_ms(lambda: kda_decode(*args, fused_finish=False, pdl=False))
        for bv in (8, 32) if QUICK else (4, 8, 16, 32):
            for nw in (1, 2, 4) if QUICK else (1, 2, 4, 8):
                ms = time_graph_per_call_ms(lambda nw=nw, bv=bv: kda_decode(*args, num_warps=nw, block_v=bv, fused_finish=True, pdl=False))
                best = (ms, bv, nw) if best is None or ms < best[0] else best
        ms, bv, nw = best
        ms3 = time_graph_per_call_ms(lambda: kda_decode(*args, num_warps=nw, block_v=bv, fused_finish=False, pdl=False))
        # PDL (state kernel launched early, its state loads overlapping the prep kernel) at the default and
        # the best config
        pdl = time_graph_per_call_ms(lambda: kda_decode(*args, fused_finish=True, pdl=True))
        pdl_best = time_graph_per_call_ms(lambda: kda_decode(*args, num_warps=nw, block_v=bv, fused_finish=True, pdl=True))
        options = (f"PDL {pdl * 1e3:.1f} µs at the default config ({pdl / default:.2f}x it), {pdl_best * 1e3:.1f} µs "
                   f"at the best ({pdl_best / ms:.2f}x)")
        byts = n * h * k * k * 4 * 2 + n * (3 * p * 2 * 2 + 3 * p * 3 * 2 * 2 + 3 * p * 2)
        floor = byts / (ceil["copy_tbs"] * 1e12) * 1e3
        for name, t, note in (
            ("two launches (fused finish)", ms, f"best of sweep: block_v {bv}, num_warps {nw}; default config "
             f"{default * 1e3:.1f} µs; {options}"),
            ("three launches (finish kernel)", ms3, f"same config as the row above ({ms3 / ms:.2f}x its time); "
             f"default config {default3 * 1e3:.1f} µs ({default3 / default:.2f}x the fused default)"),
        ):
            rows.append(f"| KDA decode, batch {n}, {name} | {t * 1e3:.1f} µs | {byts / 1e6:.1f} MB | "
                        f"{byts / t / 1e9:.2f} TB/s | {floor * 1e3:.1f} µs | {floor / t:.0%} | {note} |")
    return rows


def _kda_inputs(n: int, t: int, h: int, k: int, w: int, gen) -> tuple:
    """Random bf16 inputs for n sequences x t tokens at h heads of dim k (conv width w), and the weights,
    pools, slots (n of n + 8, shuffled) and fresh flags of `kda_decode`."""
    p, bf, slots = h * k, torch.bfloat16, n + 8
    x = torch.randn(n * t, 3 * p, device="cuda", generator=gen).to(bf)
    f = torch.randn(n * t, p, device="cuda", generator=gen).to(bf)
    b = torch.randn(n * t, h, device="cuda", generator=gen).to(bf)
    g = torch.randn(n * t, p, device="cuda", generator=gen).to(bf)
    cw = torch.randn(3 * p, w, device="cuda", generator=gen)
    conv = torch.randn(slots, 3 * p, w - 1, device="cuda", generator=gen).to(bf)
    rec = torch.randn(slots, h, k, k, device="cuda", generator=gen) * 0.02
    alog, dtb, onw = torch.zeros(h, device="cuda"), torch.zeros(p, device="cuda"), torch.ones(k, device="cuda")
    sl = torch.randperm(slots, device="cuda", generator=gen)[:n]
    fresh = torch.zeros(n, dtype=torch.bool, device="cuda")
    return x, f, b, g, cw, conv, rec, alog, dtb, onw, sl, fresh


def kda_multi_rows(ceil, gen) -> list[str]:
    """T tokens per sequence in one launch (speculative verification): the state still moves once per sequence,
    so bytes grow only by the per-token inputs and outputs, while T single-token launches move it T times."""
    h, k, w = 32, 128, 4
    p = h * k
    rows = []
    for n, t in ((1, 4), (64, 4)) if QUICK else ((1, 2), (1, 4), (1, 8), (64, 2), (64, 4), (64, 8), (256, 4)):
        x, f, b, g, *pools = _kda_inputs(n, t, h, k, w, gen)
        args = (*pools, k**-0.5, 1e-5, None)
        default = time_ms(lambda: kda_decode_multi(x, f, b, g, *args, t), 3, 50)
        per_seq = [torch.arange(n, device="cuda") * t + j for j in range(t)]
        xs, fs, bs, gs = ([y[r].contiguous() for r in per_seq] for y in (x, f, b, g))
        singles = time_ms(lambda: [kda_decode(xs[j], fs[j], bs[j], gs[j], *args) for j in range(t)], 3, 30)
        three = time_ms(lambda: kda_decode_multi(x, f, b, g, *args, t, fused_finish=False), 3, 50)
        best = None
        for bv in (16, 32) if QUICK else (8, 16, 32, 64):
            for nw in (4, 8) if QUICK else (2, 4, 8):
                ms = time_ms(lambda nw=nw, bv=bv: kda_decode_multi(x, f, b, g, *args, t, num_warps=nw, block_v=bv),
                             3, 30)
                best = (ms, f"block_v {bv}, num_warps {nw}") if best is None or ms < best[0] else best
        ms, cfg = best
        pdl = time_ms(lambda: kda_decode_multi(x, f, b, g, *args, t, pdl=True), 3, 50)
        # state and conv tails read + written once per sequence; per token q|k|v, f, gate, β in and the output out
        byts = n * (h * k * k * 4 * 2 + 3 * p * (w - 1) * 2 * 2) + n * t * (3 * p * 2 + 3 * p * 2 + h * 2)
        floor = byts / (ceil["copy_tbs"] * 1e12) * 1e3
        note = (f"best of sweep: {cfg}; default config {default * 1e3:.1f} µs (three launches, finish kernel: "
                f"{three * 1e3:.1f} µs); {t} single-token launches {singles * 1e3:.1f} µs; default config with PDL "
                f"{pdl * 1e3:.1f} µs")
        rows.append(f"| KDA decode, batch {n} x {t} tokens | {ms * 1e3:.1f} µs | {byts / 1e6:.1f} MB | "
                    f"{byts / ms / 1e9:.2f} TB/s | {floor * 1e3:.1f} µs | {floor / ms:.0%} | {note} |")
    return rows


# The MLA decode sweep: (label, mla_decode_latent knobs, split programs planned per SM, splits multiplier).
# The first entry is the default config (mla_decode_latent's defaults: layout "auto"). "rows" = rows as the products' M
# side (wgmma at block_n 64, 4 warps), "heads" = the earlier heads-as-M form (mma.sync); pf = tiles
# prefetched into L2 ahead; pdl = the combine kernel launched early. block_n 32 "rows" programs take ~110 KB of shared memory (at 3
# stages), so two fit per SM: their plan asks for twice the programs.
MLA_SWEEP = [
    ("default (auto)", dict(block_n=64), 1, 1),
    ("heads bn64 w4 s3 pf2", dict(layout="heads", block_n=64, num_warps=4, num_stages=3, prefetch=2), 1, 1),
    ("heads bn64 w8 s3 pf2", dict(layout="heads", block_n=64, num_warps=8, num_stages=3, prefetch=2), 1, 1),
    ("rows bn64 w4 s2 pf2", dict(layout="rows", block_n=64, num_warps=4, num_stages=2, prefetch=2), 1, 1),
    ("rows bn64 w4 s2 pf0", dict(layout="rows", block_n=64, num_warps=4, num_stages=2, prefetch=0), 1, 1),
    ("rows bn64 w4 s2 pf2 pdl", dict(layout="rows", block_n=64, num_warps=4, num_stages=2, prefetch=2, pdl=True), 1, 1),
    ("rows bn64 w4 s2 pf2 splits/2", dict(layout="rows", block_n=64, num_warps=4, num_stages=2, prefetch=2), 1, 0.5),
    ("rows bn64 w8 s2 pf2", dict(layout="rows", block_n=64, num_warps=8, num_stages=2, prefetch=2), 1, 1),
    ("rows bn32 w4 s3 pf2 2/SM", dict(layout="rows", block_n=32, num_warps=4, num_stages=3, prefetch=2), 2, 1),
    ("rows bn32 w4 s4 pf2", dict(layout="rows", block_n=32, num_warps=4, num_stages=4, prefetch=2), 1, 1),
    ("rows bn32 w8 s3 pf2", dict(layout="rows", block_n=32, num_warps=8, num_stages=3, prefetch=2), 1, 1),
    ("heads bn64 w8 s2 pf0", dict(layout="heads", block_n=64, num_warps=8, num_stages=2, prefetch=0), 1, 1),
    ("heads bn32 w8 s3 pf2", dict(layout="heads", block_n=32, num_warps=8, num_stages=3, prefetch=2), 1, 1),
    ("heads bn64 w4 s2 pf2", dict(layout="heads", block_n=64, num_warps=4, num_stages=2, prefetch=2), 1, 1),
    # Candidates compiled for sm_90a on the CPU (shared-memory reads of the products per 64 cache rows):
    # heads w4: 4 warps re-read q instead of 8 (296 KB vs 456 KB), 255 regs, no spill, the next tile's
    # copy overlaps the products as at w8; heads64: 64 padded heads, both products wgmma, but Triton puts
    # all 8 warps on M for a chained dot, so both warpgroups compute the whole score and read q once per
    # N block (~500 KB); bf16p: bf16 split partials (batch 1: 8.4 MB -> 4.2 MB written and read back)
    ("heads bn64 w4 s3 pf4", dict(layout="heads", block_n=64, num_warps=4, num_stages=3, prefetch=4), 1, 1),
    ("heads bn64 w8 s3 pf2 bf16p", dict(layout="heads", block_n=64, num_warps=8, num_stages=3, prefetch=2,
                                        partial_dtype=torch.bfloat16), 1, 1),
    ("heads bn64 w4 s3 pf2 bf16p", dict(layout="heads", block_n=64, num_warps=4, num_stages=3, prefetch=2,
                                        partial_dtype=torch.bfloat16), 1, 1),
    ("heads64 bn32 w8 s4 pf2", dict(layout="heads64", block_n=32, num_warps=8, num_stages=4, prefetch=2), 1, 1),
    ("heads64 bn32 w8 s3 pf4", dict(layout="heads64", block_n=32, num_warps=8, num_stages=3, prefetch=4), 1, 1),
    ("heads64 bn64 w8 s2 pf2", dict(layout="heads64", block_n=64, num_warps=8, num_stages=2, prefetch=2), 1, 1),
    ("heads64 bn32 w8 s4 pf2 bf16p", dict(layout="heads64", block_n=32, num_warps=8, num_stages=4, prefetch=2,
                                          partial_dtype=torch.bfloat16), 1, 1),
    # the Gluon kernel (mla_decode_wgmma): rows as M for both products, one warpgroup, two tile buffers
    # under its own control (the copies of tile t + 1 issued before tile t's products)
    ("wgmma bn64 pf0", dict(layout="wgmma", block_n=64, prefetch=0), 1, 1),
    ("wgmma bn64 pf2", dict(layout="wgmma", block_n=64, prefetch=2), 1, 1),
    ("wgmma bn64 pf4", dict(layout="wgmma", block_n=64, prefetch=4), 1, 1),
]
MLA_SWEEP_QUICK = [c for c in MLA_SWEEP if c[0] in (
    "default (auto)", "heads bn64 w8 s3 pf2", "rows bn64 w4 s2 pf2", "heads bn64 w4 s3 pf2", "heads bn64 w8 s3 pf2 bf16p",
    "heads bn64 w4 s3 pf2 bf16p", "heads64 bn32 w8 s4 pf2", "heads64 bn64 w8 s2 pf2", "heads64 bn32 w8 s4 pf2 bf16p",
    "wgmma bn64 pf0", "wgmma bn64 pf2", "wgmma bn64 pf4")]


def time_graph_cold_ms(fn, flush: torch.Tensor, iters: int = 10) -> float:
    """`time_graph_ms` with L2 flushed (a 256 MB write) before every timed replay: in a decode step the
    other layers' weights pass through L2 between two calls, and a batch-1 32K cache (38 MB) would
    otherwise partly stay in the 50 MB L2 from one replay to the next."""
    graph = capture_graph(fn)
    times = []
    for i in range(iters + 2):
        flush.zero_()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        if i >= 2:
            times.append(a.elapsed_time(b))
    return statistics.median(times)


def _mla_reference(qf: torch.Tensor, pages: torch.Tensor, bt: torch.Tensor, i: int, ctx: int, scale: float,
                   r: int) -> torch.Tensor:
    """o_lat [H, R] of sequence i in fp32 from its gathered rows."""
    pos = torch.arange(ctx, device=pages.device)
    rows = pages[bt[i, pos // pages.shape[2]], 0, pos % pages.shape[2]].float()
    p = torch.softmax(qf[i].float() @ rows.t() * scale, -1)
    return p @ rows[:, :r]


def mla_rows(ceil, gen) -> list[str]:
    """Paged MLA decode (split + combine kernels) replayed from a CUDA graph with a cold L2, over the knob
    sweep; floor = the cache rows (n x ctx x 576 x 2 bytes) at copy bandwidth. Every config's output is
    checked against an fp32 reference of two sequences first; a wrong one is reported, never picked."""
    hh, dn, dr, dv, r, bs, scale = 32, 128, 64, 128, 512, 64, 0.07
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    sweep = MLA_SWEEP_QUICK if QUICK else MLA_SWEEP
    rows = []
    for n, ctx in ((1, 32768), (8, 32768), (64, 8192)) if QUICK else ((1, 32768), (8, 32768), (64, 1024), (64, 8192)):
        blocks = (ctx + bs - 1) // bs
        pages = torch.randn(n * blocks, 1, bs, r + dr, device="cuda", generator=gen).to(torch.bfloat16)
        bt = torch.randperm(n * blocks, device="cuda", generator=gen).view(n, blocks)
        kvb = (torch.randn(hh * (dn + dv), r, device="cuda", generator=gen) * 0.05).to(torch.bfloat16)
        qn = torch.randn(n, hh, dn, device="cuda", generator=gen).to(torch.bfloat16)
        qr = torch.randn(n, hh, dr, device="cuda", generator=gen).to(torch.bfloat16)
        ctx_t = torch.full((n,), ctx, device="cuda")
        qf = torch.randn(n, hh, r + dr, device="cuda", generator=gen).to(torch.bfloat16)
        check = [(i, _mla_reference(qf, pages, bt, i, ctx, scale, r)) for i in sorted({0, n - 1})]
        cache_bytes = n * ctx * (r + dr) * 2
        floor = cache_bytes / (ceil["copy_tbs"] * 1e12) * 1e3
        results = []
        for label, kw, per_sm, mult in sweep:
            splits = max(1, round(plan_splits(n, 1, ctx, kw["block_n"], sms * per_sm) * mult))

            def call(kw=kw, splits=splits):
                return mla_decode_latent(qf, pages[:, 0], bt, ctx_t, ctx, scale, r, num_splits=splits, **kw)

            try:
                out = call()
                err = max(float((out[i].double() - ref.double()).norm() / ref.double().norm()) for i, ref in check)
                if not err < 2e-2:
                    results.append((None, f"{label}: WRONG (rel err {err:.2e})"))
                    continue
                t_ = time_graph_cold_ms(call, flush)
                results.append((t_, f"{label} ({splits} splits)"))
            except Exception as e:  # a config may not fit shared memory, or a knob may not compile here
                results.append((None, f"{label}: {type(e).__name__}: {str(e)[:60]}"))
            torch.cuda.synchronize()
        timed = [x for x in results if x[0] is not None]
        best_ms, best_label = min(timed) if timed else (float("nan"), "none ran")
        default_ms = results[0][0]
        whole = time_graph_cold_ms(lambda: mla_absorbed_decode_fast(qn, qr, pages, 0, bt, ctx_t, ctx, kvb, r, dv,
                                                                    scale), flush)
        warm = time_graph_ms(lambda: mla_absorbed_decode_fast(qn, qr, pages, 0, bt, ctx_t, ctx, kvb, r, dv, scale), 20)
        sweep_txt = ", ".join(f"{lab}: {t_ * 1e3:.1f}" if t_ is not None else lab for t_, lab in results)
        default_txt = f"{default_ms * 1e3:.1f} µs" if default_ms is not None else "failed"
        note = (f"kernels alone, best of sweep: {best_label}; default config {default_txt}; whole "
                f"mla_absorbed_decode_fast (W_UK/W_UV bmm, default config) {whole * 1e3:.1f} µs cold, "
                f"{warm * 1e3:.1f} µs warm L2; sweep µs: {sweep_txt}")
        rows.append(f"| MLA decode kernels, batch {n}, ctx {ctx} | {best_ms * 1e3:.1f} µs | {cache_bytes / 1e6:.1f} MB | "
                    f"{cache_bytes / best_ms / 1e9:.2f} TB/s | {floor * 1e3:.1f} µs | {floor / best_ms:.0%} | {note} |")
        print(f"MLA best config, batch {n}, ctx {ctx}: {best_label}: {best_ms * 1e3:.1f} µs = "
              f"{floor / best_ms:.0%} of copy (floor {floor * 1e3:.1f} µs)", flush=True)
        pages = bt = qf = None
        torch.cuda.empty_cache()
    return rows


def _prefill_flops(nq: int, nc: int, h: int, d_qk: int, d_v: int) -> float:
    """Useful FLOPs of causal attention of nq queries at the end of nc keys (v at its own width d_v)."""
    keys_seen = nq * (nc - nq) + nq * (nq + 1) / 2
    return 2 * h * (d_qk + d_v) * keys_seen


def _first_call_ms(fn) -> float:
    """Wall time of one call of fn() from an idle GPU to its end: a first call's host work included."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def mla_prefill_rows(ceil, gen) -> list[str]:
    """MLA prefill attention of one chunk at the 48B shape (32 heads, q/k 192, v 128; bf16), eager as the
    prefill step runs it: the one SDPA call with a lower-right causal bias (FlashAttention-2, v padded to
    192) against the split (`attention_split`: cuDNN over the cached keys unmasked and over the chunk's own
    keys causally, merged by log-sum-exp), with the split's parts and the whole `mla_prefill_fast` of both.
    TFLOP/s count the useful causal products at v's own width; floor = those FLOPs at the matmul rate.
    `TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1 python benchmarks/gpu_kernels.py --only mla_prefill` shows the
    first-call costs with torch's cuDNN plans shared across lengths (read once per process)."""
    import torch.nn.functional as F
    from torch.nn.attention.bias import causal_lower_right

    from hyserve.ops.mla_decode import (
        attention_split,
        cudnn_attention_lse,
        cudnn_split_mode,
        merge_attention,
        merge_attention_triton,
        split_values,
    )

    hh, dn, dr, dv, r, bs = 32, 128, 64, 128, 512, 64
    d, scale = dn + dr, (dn + dr) ** -0.5
    rows = []
    for nq, nc in ((8192, 8192), (512, 4096), (2049, 12288), (8192, 16384), (8192, 32768)):
        q = torch.randn(nq, hh, d, device="cuda", generator=gen).to(torch.bfloat16)
        k = torch.randn(nc, hh, d, device="cuda", generator=gen).to(torch.bfloat16)
        kv = torch.randn(nc, hh, dn + dv, device="cuda", generator=gen).to(torch.bfloat16)
        v_narrow = kv[..., dn:]
        v_pad = F.pad(v_narrow, (0, d - dv))
        mode = cudnn_split_mode(q, k, v_narrow)
        qi, ki = q.transpose(0, 1)[None], k.transpose(0, 1)[None]
        vi = split_values(v_narrow, mode, d).transpose(0, 1)[None] if mode else None
        out = torch.empty(nq, hh, dv, device="cuda", dtype=torch.bfloat16)
        flops = _prefill_flops(nq, nc, hh, d, dv)
        floor = flops / (ceil["mm_tflops"] * 1e12) * 1e3
        old = time_ms(lambda: F.scaled_dot_product_attention(qi, ki, v_pad.transpose(0, 1)[None],
                                                             attn_mask=causal_lower_right(nq, nc), scale=scale))

        def row(label: str, ms: float, note: str) -> str:
            return (f"| MLA prefill attention, {nq} queries over {nc} keys, {label} | {ms:.3f} ms | - | "
                    f"{flops / ms / 1e9:.0f} TFLOP/s | {floor:.3f} ms | {floor / ms:.0%} | {note} |")

        # a shape cuDNN has not seen builds its execution plans on the first call (host time), once per
        # shape and thread unless TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1 buckets the lengths; FA2 builds none
        old_first = _first_call_ms(lambda: F.scaled_dot_product_attention(
            qi[:, :, 1:], ki[:, :, 1:], v_pad.transpose(0, 1)[None, :, 1:], attn_mask=causal_lower_right(nq - 1, nc - 1),
            scale=scale))
        if nq == nc:  # a fresh prompt: one plain causal call either way
            rows.append(row("causal call (fresh prompt)", old,
                            f"SDPA is_causal, v padded to 192; first call of a new length {old_first:.1f} ms wall"))
            continue
        rows.append(row("one lower-right call", old, f"SDPA causal_lower_right, v padded to 192; first call of a new "
                                                     f"shape {old_first:.1f} ms wall"))
        if mode is None:
            rows.append(row("split", float("nan"), "no cuDNN split here: mla_prefill_fast keeps the one call"))
            continue
        ctx = nc - nq
        ms = time_ms(lambda: attention_split(qi, ki, vi, scale, cudnn_attention_lse, dv,
                                             out=out.transpose(0, 1)[None]))
        part_a = time_ms(lambda: cudnn_attention_lse(qi, ki[:, :, :ctx], vi[:, :, :ctx], False, scale))
        part_b = time_ms(lambda: cudnn_attention_lse(qi, ki[:, :, ctx:], vi[:, :, ctx:], True, scale))
        o_a, lse_a = cudnn_attention_lse(qi, ki[:, :, :ctx], vi[:, :, :ctx], False, scale)
        o_b, lse_b = cudnn_attention_lse(qi, ki[:, :, ctx:], vi[:, :, ctx:], True, scale)
        merge = time_ms(lambda: merge_attention_triton(o_a[..., :dv], lse_a, o_b[..., :dv], lse_b,
                                                       out=out.transpose(0, 1)[None]))
        merge_torch = time_ms(lambda: merge_attention(o_a[..., :dv], lse_a, o_b[..., :dv], lse_b,
                                                      out=out.transpose(0, 1)[None]))
        first = _first_call_ms(lambda: attention_split(qi[:, :, 1:], ki[:, :, 1:], vi[:, :, 1:], scale,
                                                       cudnn_attention_lse, dv))
        rows.append(row(f"split ({mode} v)", ms,
                        f"{old / ms:.2f}x the one call; cuDNN over the {ctx} cached keys {part_a:.3f} ms, over the "
                        f"chunk causally {part_b:.3f} ms, merge {merge:.3f} ms (Triton; torch ops {merge_torch:.3f}); "
                        f"first call of a new shape {first:.1f} ms wall"))
        q = k = kv = v_pad = v_narrow = qi = ki = vi = o_a = o_b = None
        torch.cuda.empty_cache()
    rows += _mla_prefill_whole_rows(gen, hh, dn, dr, dv, r, bs, scale)
    return rows


def _mla_prefill_whole_rows(gen, hh: int, dn: int, dr: int, dv: int, r: int, bs: int, scale: float) -> list[str]:
    """The whole `mla_prefill_fast` (row gather, up-projection GEMM, v padding, attention) of one layer for
    one chunk over a cached context, with split=False (the one lower-right call) and split=True (the split,
    through cuDNN where it serves the inputs)."""
    from hyserve.ops.mla_decode import mla_prefill_fast

    rows = []
    for nq, nc in ((2049, 12288), (8192, 16384)):
        blocks = (nc + bs - 1) // bs
        pages = torch.randn(blocks, 1, bs, r + dr, device="cuda", generator=gen).to(torch.bfloat16)
        bt = torch.randperm(blocks, device="cuda", generator=gen).view(1, blocks)
        kvb = (torch.randn(hh * (dn + dv), r, device="cuda", generator=gen) * 0.05).to(torch.bfloat16)
        qn = torch.randn(nq, hh, dn, device="cuda", generator=gen).to(torch.bfloat16)
        qr = torch.randn(nq, hh, dr, device="cuda", generator=gen).to(torch.bfloat16)
        t = {split: time_ms(lambda split=split: mla_prefill_fast(qn, qr, pages, 0, bt, [nq], [nc], kvb, r, dv, scale,
                                                                split=split))
             for split in (False, True)}
        flops = _prefill_flops(nq, nc, hh, dn + dr, dv)
        rows.append(f"| mla_prefill_fast, {nq} queries over {nc} keys (one layer) | {t[True]:.3f} ms | - | "
                    f"{flops / t[True] / 1e9:.0f} TFLOP/s | - | - | split=False (one lower-right call) "
                    f"{t[False]:.3f} ms = {flops / t[False] / 1e9:.0f} TFLOP/s: {t[False] / t[True]:.2f}x |")
    return rows


def byts_of(ids, d, inter) -> float:
    return int(torch.unique(ids).numel()) * 3 * d * inter * 2


def moe_rows(ceil, gen) -> list[str]:
    e, d, inter, k = 256, 2304, 1024, 8
    w13 = (torch.randn(e, 2 * inter, d, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
    w2 = (torch.randn(e, d, inter, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
    gw = torch.randn(e, d, device="cuda", generator=gen) * 0.02
    act = GLU("silu")
    rows = []
    for t in (1, 8, 64, 256, 1024, 4096):
        x = torch.randn(t, d, device="cuda", generator=gen).to(torch.bfloat16)
        ids, w = moe_ref.route(x, gw, None, k, renormalize=True, scaling=2.446)
        ms = time_graph_ms(lambda: experts_forward_grouped(x, ids, w, w13, w2, act), 20)
        tm = time_graph_ms(lambda: experts_forward_triton(x, ids, w, w13, w2, act), 20)
        note = f"Triton grouped GEMM: {tm * 1e3:.1f} µs = {byts_of(ids, d, inter) / tm / 1e9:.2f} TB/s, {ms / tm:.2f}x grouped_mm"
        if t <= 8:
            gm = time_graph_ms(lambda: experts_forward_gemv(x, ids, w, w13, w2, act), 20)
            gm0 = time_graph_ms(lambda: experts_forward_gemv(x, ids, w, w13, w2, act, pdl=False), 20)
            note += (f"; Triton GEMV path: {gm * 1e3:.1f} µs = {byts_of(ids, d, inter) / gm / 1e9:.2f} TB/s, "
                     f"without PDL {gm0 * 1e3:.1f} µs ({gm0 / gm:.2f}x)")
        distinct = int(torch.unique(ids).numel())
        byts = distinct * 3 * d * inter * 2
        flops = 2 * t * k * 3 * d * inter
        floor = max(byts / (ceil["copy_tbs"] * 1e12), flops / (ceil["mm_tflops"] * 1e12)) * 1e3
        rows.append(f"| MoE grouped_mm, {t} tokens ({distinct} experts) | {ms * 1e3:.1f} µs | {byts / 1e6:.1f} MB | "
                    f"{byts / ms / 1e9:.2f} TB/s, {flops / ms / 1e9:.0f} TFLOP/s | {floor * 1e3:.1f} µs | "
                    f"{floor / ms:.0%} | {note} |")
    return rows


def kda_prefill_rows(ceil, gen) -> list[str]:
    """The prefill step's short conv and output norm at 2K and 8K tokens of the 48B shape: the Triton kernels
    against the torch versions they replace on the GPU."""
    h, k, w = 32, 128, 4
    p = h * k
    rows = []
    for t in (2048, 8192):
        x = torch.randn(t, 3 * p, device="cuda", generator=gen).to(torch.bfloat16)
        cw = torch.randn(3 * p, w, device="cuda", generator=gen)
        cu = torch.tensor([0, t], device="cuda")
        tails = torch.randn(1, 3 * p, w - 1, device="cuda", generator=gen).to(torch.bfloat16)
        ms_t = time_ms(lambda: causal_conv_varlen(x, cw, cu, tails), 2, 10)
        ms_k = time_ms(lambda: causal_conv_varlen_triton(x, cw, cu, tails), 2, 10)
        byts = 2 * x.numel() * 2
        floor = byts / (ceil["copy_tbs"] * 1e12) * 1e3
        rows.append(f"| KDA prefill conv, {t} tokens | {ms_k * 1e3:.1f} µs | {byts / 1e6:.1f} MB | "
                    f"{byts / ms_k / 1e9:.2f} TB/s | {floor * 1e3:.1f} µs | {floor / ms_k:.0%} | torch version "
                    f"{ms_t * 1e3:.1f} µs ({ms_t / ms_k:.1f}x) |")
        o = torch.randn(t, h, k, device="cuda", generator=gen).to(torch.bfloat16)
        g = torch.randn(t, p, device="cuda", generator=gen).to(torch.bfloat16)
        wn = torch.ones(k, device="cuda")
        ms_t = time_ms(lambda: gated_rms_norm(o, g.view(t, h, k), wn, 1e-5).reshape(t, p).to(torch.bfloat16), 2, 10)
        ms_k = time_ms(lambda: gated_rms_norm_rows(o, g, wn, 1e-5, torch.bfloat16), 2, 10)
        byts = 3 * o.numel() * 2
        floor = byts / (ceil["copy_tbs"] * 1e12) * 1e3
        rows.append(f"| KDA prefill gated norm, {t} tokens | {ms_k * 1e3:.1f} µs | {byts / 1e6:.1f} MB | "
                    f"{byts / ms_k / 1e9:.2f} TB/s | {floor * 1e3:.1f} µs | {floor / ms_k:.0%} | torch version "
                    f"{ms_t * 1e3:.1f} µs ({ms_t / ms_k:.1f}x) |")
    return rows



def _copies(shape, total_bytes: float, gen) -> list[torch.Tensor]:
    """Enough distinct bf16 weights of shape to stream about total_bytes (past the 50 MB L2), as a decode
    step streams a different layer's weight each call."""
    one = torch.Size(shape).numel() * 2
    return [(torch.randn(*shape, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
            for _ in range(max(1, int(total_bytes // one)))]


def gemv_rows(ceil, gen) -> list[str]:
    """Single-token projections of the 48B shape, each call on another copy of the weight in one graph:
    cuBLAS (F.linear) against the Triton GEMV (ops/dense_gemv.py) over a sweep of its tiles and K splits, and
    the tiles the kernel plan's rule picks (`kernel_plan.gemv_config`)."""
    from hyserve.ops.dense_gemv import gemv
    from hyserve.ops.kernel_plan import gemv_config

    shapes = {"attention output (o_proj)": (2304, 4096), "KDA merged input": (12576, 2304),
              "MLA q | kv_a": (6720, 2304), "layer-0 MLP gate/up": (9216, 2304), "layer-0 MLP down": (2304, 9216),
              "lm_head": (163840, 2304)}
    sweep = [(bn, bk, nw, st, split) for bn, bk in ((16, 256), (32, 128), (16, 512), (32, 256))
             for nw in (4, 8) for st in (3, 4) for split in (1, 2, 4)]
    rows = []
    for name, (n, k) in shapes.items():
        ws = _copies((n, k), 200e6, gen)
        x = torch.randn(1, k, device="cuda", generator=gen).to(torch.bfloat16)
        byts = n * k * 2
        ref = time_graph_ms(lambda: [torch.nn.functional.linear(x, w) for w in ws], 10) / len(ws)
        best = None
        for cfg in sweep:
            ms = time_graph_ms(lambda cfg=cfg: [gemv(x, w, cfg) for w in ws], 10) / len(ws)
            best = (ms, cfg) if best is None or ms < best[0] else best
        ms, cfg = best
        rule = gemv_config(n, k, False, torch.cuda.get_device_properties(0).multi_processor_count)
        rule_ms = time_graph_ms(lambda: [gemv(x, w, rule) for w in ws], 10) / len(ws)
        floor = byts / (ceil["copy_tbs"] * 1e12) * 1e3
        rows.append(f"| GEMV 1 token, {name} {n}x{k} | {ms * 1e3:.1f} µs | {byts / 1e6:.1f} MB | "
                    f"{byts / ms / 1e9:.2f} TB/s | {floor * 1e3:.1f} µs | {floor / ms:.0%} | best tile (BN, BK, warps, "
                    f"stages, K splits) {cfg}; cuBLAS {ref * 1e3:.1f} µs = {byts / ref / 1e9:.2f} TB/s, {ref / ms:.2f}x; "
                    f"the plan's rule {rule} {rule_ms * 1e3:.1f} µs |")
    return rows


def gemv_tokens_rows(ceil, gen) -> list[str]:
    """The 48B dense projections at a verify step's 5 and 8 tokens, each call on another copy of the weight in
    one graph: cuBLAS (F.linear, what the kernel plan runs there today) against `gemv_tokens` (the weight
    streamed once, one tensor-core dot a tile) over a sweep of tiles and K splits, and `gemv`'s per-token
    loop with the plan's one-token tiles. Which projections a verify step should send to `gemv_tokens` is
    read off this table."""
    from hyserve.ops.dense_gemv import gemv, gemv_tokens
    from hyserve.ops.kernel_plan import gemv_config

    shapes = {"attention output (o_proj)": (2304, 4096), "KDA merged input": (12576, 2304),
              "MLA q | kv_a": (6720, 2304), "lm_head": (163840, 2304)}
    sweep = [(bn, bk, nw, st, split) for bn, bk in ((16, 256), (32, 128), (64, 64), (32, 256))
             for nw in (4, 8) for st in (3, 4) for split in (1, 2, 4)]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for name, (n, k) in shapes.items():
        ws = _copies((n, k), 200e6, gen)
        byts = n * k * 2
        floor = byts / (ceil["copy_tbs"] * 1e12) * 1e3
        for t in (5, 8):
            x = torch.randn(t, k, device="cuda", generator=gen).to(torch.bfloat16)
            ref = time_graph_ms(lambda: [torch.nn.functional.linear(x, w) for w in ws], 10) / len(ws)
            loop = time_graph_ms(lambda: [gemv(x, w, gemv_config(n, k, False, sms)) for w in ws], 10) / len(ws)
            best = None
            for cfg in sweep:
                ms = time_graph_ms(lambda cfg=cfg: [gemv_tokens(x, w, cfg) for w in ws], 10) / len(ws)
                best = (ms, cfg) if best is None or ms < best[0] else best
            ms, cfg = best
            rows.append(f"| {t} tokens, {name} {n}x{k} | {ms * 1e3:.1f} µs | {byts / 1e6:.1f} MB | "
                        f"{byts / ms / 1e9:.2f} TB/s | {floor * 1e3:.1f} µs | {floor / ms:.0%} | gemv_tokens best tile "
                        f"{cfg}; cuBLAS {ref * 1e3:.1f} µs ({ref / ms:.2f}x); the per-token GEMV loop "
                        f"{loop * 1e3:.1f} µs |")
    return rows


def router_rows(ceil, gen) -> list[str]:
    """The 48B router (256 experts x 2304, fp32 weight) at 1, 4, 5 and 8 tokens (5, 8: verify steps of 4, 7 drafts): `router_fused` (partial logits over
    a grid of weight tiles, then the selection kernel) against the cast + cuBLAS GEMV + selection kernel, 26
    layers' weights in one graph."""
    from hyserve.ops.router_topk import route_topk_fast, router_fused

    rows = []
    ws = [torch.randn(256, 2304, device="cuda", generator=gen) * 0.02 for _ in range(26)]
    bias = torch.randn(256, device="cuda", generator=gen) * 0.01
    for t in (1, 4, 5, 8):
        x = torch.randn(t, 2304, device="cuda", generator=gen).to(torch.bfloat16)
        old = time_graph_ms(lambda: [route_topk_fast(x.float() @ w.t(), bias, 8, True, 2.446) for w in ws], 10) / 26
        best = None
        for be in (4, 8, 16):
            for bd in (128, 256, 512):
                for nw in (2, 4):
                    ms = time_graph_ms(lambda be=be, bd=bd, nw=nw: [router_fused(x, w, bias, 8, True, 2.446, be, bd, nw)
                                                                  for w in ws], 10) / 26
                    best = (ms, (be, bd, nw)) if best is None or ms < best[0] else best
        ms, cfg = best
        byts = 256 * 2304 * 4
        floor = byts / (ceil["copy_tbs"] * 1e12) * 1e3
        rows.append(f"| router {t} token(s), tile GEMV + selection | {ms * 1e3:.1f} µs | {byts / 1e6:.1f} MB | "
                    f"{byts / ms / 1e9:.2f} TB/s | {floor * 1e3:.1f} µs | {floor / ms:.0%} | best (block_e, block_d, "
                    f"warps) {cfg}; cast + GEMV + selection {old * 1e3:.1f} µs, {old / ms:.2f}x |")
    return rows

SECTIONS = {"kda": kda_rows, "kda_prefill": kda_prefill_rows, "kda_multi": kda_multi_rows, "mla": mla_rows,
            "mla_prefill": mla_prefill_rows, "moe": moe_rows,
            "gemv": gemv_rows, "gemv_tokens": gemv_tokens_rows, "router": router_rows}


def main(ceil=None, argv: list[str] | None = None) -> None:
    """`ceil`: ceilings measured by the caller (gpu_all.py), which also means its command line is not ours."""
    if argv is None:
        argv = [] if ceil is not None else sys.argv[1:]
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", default=",".join(SECTIONS), help="comma-separated sections: " + ", ".join(SECTIONS))
    args = p.parse_args(argv)
    ceil = ceil or ceilings()
    gen = torch.Generator("cuda").manual_seed(0)
    table = [f"Ceilings measured in this run: copy {ceil['copy_tbs']:.2f} TB/s (read+write), bf16 matmul "
             f"{ceil['mm_tflops']:.0f} TFLOP/s.", "",
             "| kernel | median | bytes | achieved | floor | floor/time | note |", "|---|---|---|---|---|---|---|"]
    for name in args.only.split(","):
        table += SECTIONS[name](ceil, gen)
    command = " ".join(["python benchmarks/gpu_kernels.py", *argv])
    report("GPU kernel micro-benchmarks", command, table,
           ["Floors: bytes over the measured copy bandwidth (MoE: the larger of that and FLOPs over the "
            "matmul rate). Targets: KDA decode ≥80% at batch ≥64, MLA decode ≥70% at 32K."], "kernels.md")


if __name__ == "__main__":
    main()
