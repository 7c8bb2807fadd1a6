# ruff: noqa: B023  (timing lambdas run inside the loop that binds them)
"""One K3.1 full-attention layer's attention at K3 width: dense paged MLA over the FP8 latent vs DSA
(indexer + sparse MLA), decode batch 1/16/64 at 32K/128K(/512K) contexts, plus chunked prefill per layer.

`python benchmarks/dsa_decode.py [--heads 96|12] [--contexts 32768,131072,524288]`. 96 heads is the whole
layer (TP1); 12 is its TP8 shard. The latent and the index keys are single-headed, so their bytes per step
are the same at either width; the indexer (32 heads × 128) is not sharded here. Timed: the attention core
only (the q/kv projections are the same in both paths), plus the indexer's three projections in the DSA
column. The dense kernel reads e4m3 pages with an e4m3 query (timing only; numerics are checked against
the references in tests/gpu). Appends a table to docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import math

import torch

LATENT_ROW = 576  # FP8 latent bytes per token and layer (spec §6.1)
INDEX_KEY = 132  # FP8 index key bytes per token and layer
SORT_KEY = 8  # the indexer's int64 composite key per (row, position): written once, read by topk
TOPK, HI, DI, R, DR, DN, DV, QLORA, HIDDEN, BS = 2048, 32, 128, 512, 64, 128, 128, 1536, 7168, 64


def dense_bytes(batch: int, ctx: int, row: int = LATENT_ROW) -> int:
    """Dense decode reads every cached latent row of every sequence once."""
    return batch * ctx * row


def indexer_bytes(batch: int, ctx: int, key: int = INDEX_KEY, sort_key: int = SORT_KEY) -> int:
    """The indexer reads every index key once and writes + reads one sort key per position."""
    return batch * ctx * (key + 2 * sort_key)


def sparse_bytes(batch: int, ctx: int, topk: int = TOPK, row: int = LATENT_ROW) -> int:
    """Sparse MLA reads only the selected rows (each at most once per query row)."""
    return batch * min(topk, ctx) * row


def dsa_bytes(batch: int, ctx: int) -> int:
    return indexer_bytes(batch, ctx) + sparse_bytes(batch, ctx)


def _cache(n: int, ctx: int, gen):
    """Distinct pages per sequence (no L2 sharing between sequences): FP8 latent and FP8 index keys."""
    blocks = math.ceil(ctx / BS)
    nb = n * blocks
    pages = torch.randn(nb, 1, BS, R + DR, device="cuda", generator=gen).to(torch.float8_e4m3fn)
    from hyserve.ops import dsa_indexer as dsa

    keys = torch.empty(nb, 1, BS, INDEX_KEY, dtype=torch.uint8, device="cuda")
    for b0 in range(0, nb, 4096):  # encode in slices to bound the temporary
        b1 = min(nb, b0 + 4096)
        k = torch.randn((b1 - b0) * BS, DI, device="cuda", generator=gen).to(torch.bfloat16)
        dsa.write_key_records(keys, "fp8", 0, torch.arange(b0 * BS, b1 * BS, device="cuda"), dsa.quantize_fp8_keys(k))
    bt = torch.randperm(nb, device="cuda", generator=gen).view(n, blocks)
    return pages, keys, bt


# stage-1 kernel configs timed side by side: (block_n, positions per program or None for the default,
# warps, stages, FP8 dot); the first is the default (FP8 dot; fp16 is the exact one: index_sort_keys).
STAGE1_CONFIGS = [
    (128, None, 4, 2, True), (128, 512, 4, 3, True), (128, 2048, 4, 3, True), (64, None, 4, 3, True),
    (256, None, 8, 3, True), (128, None, 4, 3, True), (128, None, 4, 2, False), (128, 1024, 4, 2, False),
]


def _indexer_stages(args, gen, ceil) -> list[str]:
    """The indexer's two stages on their own: the scoring kernel (reads every FP8 key, writes one int64 sort
    key per position: its bandwidth is the kernel's target) and torch.topk over the sort keys."""
    from gpu_common import time_graph_ms, time_ms

    from hyserve.ops import dsa_indexer as dsa
    from hyserve.ops.dsa_index_triton import index_sort_keys, topk_from_sort_keys

    rows = ["", "| batch | context | scoring kernel (BN, chunk, warps, stages, dot) | scoring ms, called | scoring ms, "
            "graph replay | key+sort bytes MB | TB/s (replay) | % of copy | topk ms | quantise q ms |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for case in args.stages.split(","):
        n, ctx = (int(v) for v in case.split("x"))
        _, keys, bt = _cache(n, ctx, gen)  # the latent pages are dropped at once: only the keys are read
        q = torch.randn(n, HI, DI, device="cuda", generator=gen).to(torch.bfloat16)
        w = torch.randn(n, HI, device="cuda", generator=gen) * HI**-0.5
        positions = torch.full((n,), ctx - 1, device="cuda")
        t_q = time_ms(lambda: dsa.quantize_queries(q, w))
        q8, wf = dsa.quantize_queries(q, w)
        moved = n * ctx * (INDEX_KEY + SORT_KEY)
        comp = None
        for bn, chunk, warps, stages, fp8_dot in STAGE1_CONFIGS:
            def stage1():
                return index_sort_keys(q8, wf, keys, 0, "fp8", bt, [1] * n, positions, ctx, block_n=bn,
                                       chunk=chunk, num_warps=warps, num_stages=stages, fp8_dot=fp8_dot)
            config = f"{bn}, {chunk or 'default'}, {warps}, {stages}, {'fp8' if fp8_dot else 'fp16 (exact)'}"
            try:
                t0 = time_ms(stage1)  # each call waits for the last: includes the host's launch path
                t1 = time_graph_ms(stage1)  # the kernel alone, as a graphed decode step runs it
            except Exception as e:  # a config the compiler refuses (shared memory): say so, go on
                rows.append(f"| {n} | {ctx} | {config} | failed: {type(e).__name__}: {str(e)[:80]} |||||||")
                print(rows[-1], flush=True)
                continue
            if comp is None:
                comp = stage1()
                t_top = time_ms(lambda: topk_from_sort_keys(comp, positions, TOPK))
            tbs = moved / t1 / 1e9
            rows.append(f"| {n} | {ctx} | {config} | {t0:.3f} | {t1:.3f} | {moved / 1e6:.1f} | {tbs:.2f} | "
                        f"{100 * tbs / ceil['copy_tbs']:.0f}% | {t_top:.3f} | {t_q:.3f} |")
            print(rows[-1], flush=True)
        keys = bt = comp = None
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from gpu_common import ceilings, report, time_graph_ms, time_ms

    from hyserve.ops.dsa_index_triton import index_topk_fast
    from hyserve.ops.mla_decode import mla_decode_latent, mla_prefill_fast
    from hyserve.ops.sparse_mla_triton import sparse_mla_fast

    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", type=int, default=96)
    ap.add_argument("--contexts", default="32768,131072,524288")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--prefill", default="32768,131072")
    ap.add_argument("--chunk", type=int, default=4096)
    ap.add_argument("--stages", default="16x131072,64x131072",
                    help="BATCHxCONTEXT decode cases whose indexer is timed stage by stage over kernel configs")
    args = ap.parse_args()
    h, gen = args.heads, torch.Generator(device="cuda").manual_seed(0)
    ceil = ceilings()
    bw = ceil["copy_tbs"] * 1e12 / 2  # bytes/s of reads (the copy figure counts read + write)
    scale = (DN + DR) ** -0.5
    wq = torch.randn(HI * DI, QLORA, device="cuda", dtype=torch.bfloat16) * 0.02
    wk = torch.randn(DI, HIDDEN, device="cuda", dtype=torch.bfloat16) * 0.02
    wp = torch.randn(HI, HIDDEN, device="cuda") * 0.02
    kvb = torch.randn(h * (DN + DV), R, device="cuda", dtype=torch.bfloat16) * 0.05
    rows = ["| batch | context | dense MB/step | dense ms | DSA MB/step | DSA ms | indexer ms (share) | sparse MLA ms | "
            "dense/DSA |", "|---|---|---|---|---|---|---|---|---|"]

    def decode_ms(fn) -> float:
        """GPU time of one decode call replayed from a CUDA graph, as the engine runs decode steps."""
        try:
            return time_graph_ms(fn)
        except RuntimeError as e:  # not capturable: time the calls, host launch path included
            print(f"graph capture failed ({str(e)[:80]}); timing calls", flush=True)
            return time_ms(fn)

    def indexer(x, q_lat, keys, bt, qlens, ctxs, positions):
        q = (q_lat @ wq.t()).view(-1, HI, DI)
        w = (x.float() @ wp.t()) * HI**-0.5
        _ = torch.nn.functional.layer_norm((x @ wk.t()).float(), (DI,))  # the step's own key (not stored)
        return index_topk_fast(q, w, keys, 0, "fp8", bt, qlens, ctxs, positions, TOPK)

    for ctx in [int(c) for c in args.contexts.split(",")]:
        for n in [int(b) for b in args.batches.split(",")]:
            need = n * ctx * (LATENT_ROW + INDEX_KEY) + n * ctx * SORT_KEY
            if need > 0.6 * torch.cuda.mem_get_info()[0]:
                rows.append(f"| {n} | {ctx} | (skipped: {need / 2**30:.0f} GiB) |||||||")
                continue
            pages, keys, bt = _cache(n, ctx, gen)
            x = torch.randn(n, HIDDEN, device="cuda", generator=gen).to(torch.bfloat16)
            q_lat = torch.randn(n, QLORA, device="cuda", generator=gen).to(torch.bfloat16)
            q_full = torch.randn(n, h, R + DR, device="cuda", generator=gen).to(torch.float8_e4m3fn)
            qn = torch.randn(n, h, DN, device="cuda", generator=gen).to(torch.bfloat16)
            qr = torch.randn(n, h, DR, device="cuda", generator=gen).to(torch.bfloat16)
            ctx_t = torch.full((n,), ctx, device="cuda")
            positions = torch.full((n,), ctx - 1, device="cuda")
            seq = torch.arange(n, device="cuda", dtype=torch.int32)
            qlens, ctxs = [1] * n, [ctx] * n
            try:
                t_dense = decode_ms(lambda: mla_decode_latent(q_full, pages[:, 0], bt, ctx_t, ctx, scale, R))
            except Exception as e:  # an e4m3 x e4m3 dot the compiler refuses: time bf16 rows, twice the bytes
                print(f"dense FP8 decode failed ({type(e).__name__}); timing bf16 rows instead", flush=True)
                pages_bf, q_bf = pages[:, 0].to(torch.bfloat16), q_full.to(torch.bfloat16)
                t_dense = decode_ms(lambda: mla_decode_latent(q_bf, pages_bf, bt, ctx_t, ctx, scale, R))
                pages_bf = None
            sel = indexer(x, q_lat, keys, bt, qlens, ctxs, positions)
            t_idx = decode_ms(lambda: indexer(x, q_lat, keys, bt, qlens, ctxs, positions))
            t_sp = decode_ms(lambda: sparse_mla_fast(qn, qr, pages, 0, bt, seq, sel, kvb, R, DV, scale, 0.02))
            db, sb = dense_bytes(n, ctx), dsa_bytes(n, ctx)
            t_dsa = t_idx + t_sp
            rows.append(
                f"| {n} | {ctx} | {db / 1e6:.1f} | {t_dense:.3f} | {sb / 1e6:.1f} | {t_dsa:.3f} | "
                f"{t_idx:.3f} ({100 * t_idx / t_dsa:.0f}%) | {t_sp:.3f} | {t_dense / t_dsa:.2f}x |"
            )
            print(rows[-1], flush=True)
            pages = keys = bt = sel = None  # free before the next, larger cache
            torch.cuda.empty_cache()

    stages = _indexer_stages(args, gen, ceil) if args.stages else []
    pre = ["", "| prefill tokens | dense ms/layer | DSA ms/layer | indexer ms (share) | sparse MLA ms |",
           "|---|---|---|---|---|"]
    for total in [int(c) for c in args.prefill.split(",") if c]:
        pages, keys, bt = _cache(1, total, gen)
        pages_bf = pages.to(torch.bfloat16)  # the expanded dense prefill path reads bf16 rows
        t_dense = t_idx = t_sp = 0.0
        for end in range(args.chunk, total + 1, args.chunk):  # chunked prefill, chunk rows per step
            c = args.chunk
            x = torch.randn(c, HIDDEN, device="cuda", generator=gen).to(torch.bfloat16)
            q_lat = torch.randn(c, QLORA, device="cuda", generator=gen).to(torch.bfloat16)
            qn = torch.randn(c, h, DN, device="cuda", generator=gen).to(torch.bfloat16)
            qr = torch.randn(c, h, DR, device="cuda", generator=gen).to(torch.bfloat16)
            positions = torch.arange(end - c, end, device="cuda")
            seq = torch.zeros(c, device="cuda", dtype=torch.int32)
            t_dense += time_ms(lambda: mla_prefill_fast(qn, qr, pages_bf, 0, bt, [c], [end], kvb, R, DV, scale), 1, 1)
            sel = indexer(x, q_lat, keys, bt, [c], [end], positions)
            t_idx += time_ms(lambda: indexer(x, q_lat, keys, bt, [c], [end], positions), 1, 1)
            t_sp += time_ms(lambda: sparse_mla_fast(qn, qr, pages, 0, bt, seq, sel, kvb, R, DV, scale, 0.02), 1, 1)
        t_dsa = t_idx + t_sp
        pre.append(f"| {total} | {t_dense:.1f} | {t_dsa:.1f} | {t_idx:.1f} ({100 * t_idx / t_dsa:.0f}%) | {t_sp:.1f} |")
        print(pre[-1], flush=True)
        pages = pages_bf = keys = bt = None
        torch.cuda.empty_cache()

    notes = [
        f"Ceilings in this run: copy {ceil['copy_tbs']:.2f} TB/s, bf16 matmul {ceil['mm_tflops']:.0f} TFLOP/s "
        f"({bw / 1e12:.2f} TB/s of reads).",
        f"{h} attention heads ({'whole layer, TP1' if h == 96 else 'TP8 shard' if h == 12 else 'custom'}); indexer "
        f"{HI}×{DI}, top-{TOPK}, 64-token pages, distinct pages per sequence. Bytes: dense = N·ctx·576 (FP8 latent); "
        "DSA = N·ctx·(132 key + 2·8 sort key) + N·min(2048, ctx)·576. Prefill: chunks of "
        f"{args.chunk} rows; dense prefill is the expanded SDPA path over bf16 rows. Decode times are CUDA-graph "
        "replays (GPU time, as the engine runs decode steps); prefill times are calls.",
    ]
    report(f"DSA vs dense MLA attention, one K3.1 layer at {h} heads", "python benchmarks/dsa_decode.py",
           rows + stages + pre, notes, "dsa_decode.md")


if __name__ == "__main__":
    main()
