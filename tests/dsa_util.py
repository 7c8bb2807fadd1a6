"""Shared by the DSA tests: run a model over sequences split into arbitrary steps through the paged cache."""

from __future__ import annotations

import torch

from hyserve.models.batch import Batch
from hyserve.ops import dsa_indexer as dsa


@torch.inference_mode()
def run_steps(model, seqs: list[list[int]], steps: list[list[int]], block_size: int = 8) -> list[torch.Tensor]:
    """Feed each sequence in the given step sizes (one step = one Batch with every sequence that still has
    tokens); block tables are scrambled so paging is exercised. Returns each sequence's logits [n, V]."""
    per_seq = [-(-len(s) // block_size) for s in seqs]
    cache = model.make_cache(sum(per_seq), block_size, len(seqs))
    ids = torch.randperm(sum(per_seq), generator=torch.Generator().manual_seed(0)).tolist()
    tables, at = [], 0
    for n in per_seq:
        tables.append(ids[at : at + n])
        at += n
    done, out = [0] * len(seqs), [[] for _ in seqs]
    for step in range(max(len(s) for s in steps)):
        live = [i for i in range(len(seqs)) if step < len(steps[i])]
        q = [steps[i][step] for i in live]
        batch = Batch.build(q, [done[i] + n for i, n in zip(live, q)], [tables[i] for i in live], block_size,
                            live, [done[i] == 0 for i in live])
        tok = torch.tensor([t for i, n in zip(live, q) for t in seqs[i][done[i] : done[i] + n]])
        logits = model.compute_logits(model(tok, batch, cache))
        at = 0
        for i, n in zip(live, q):
            out[i].append(logits[at : at + n])
            done[i] += n
            at += n
    return [torch.cat(o) for o in out]


# ---- paged index-key pools and the R1 contract (spec/models.md §4.6), for the kernel tests ----------------

BS = 16


def paged_pool(
    ctx: list[int], width: int, dtype: torch.dtype, layers: int = 2, seed: int = 0, device="cpu", bs: int = BS
):
    """A pool [blocks, layers, BS, width] whose blocks are handed to the sequences in scrambled order."""
    gen = torch.Generator().manual_seed(seed)
    blocks = [-(-c // bs) for c in ctx]
    nb = sum(blocks) + 2
    perm = torch.randperm(nb, generator=gen)
    bt = torch.full((len(ctx), max(blocks)), -1, dtype=torch.long)
    at = 0
    for i, n in enumerate(blocks):
        bt[i, :n] = perm[at : at + n]
        at += n
    return torch.zeros(nb, layers, bs, width, dtype=dtype, device=device), bt.to(device)


def write_keys(pool: torch.Tensor, bt: torch.Tensor, layer: int, keys: list[torch.Tensor], fmt: str) -> None:
    for i, k in enumerate(keys):
        pos = torch.arange(k.shape[0], device=pool.device)
        dsa.write_key_records(pool, fmt, layer, bt[i, pos // pool.shape[2]] * pool.shape[2] + pos % pool.shape[2],
                              dsa.encode_keys(k, fmt))


def reference_scores(q, w, pool, bt, layer, fmt, seq: int, ctx: int) -> torch.Tensor:
    """R1 scores [rows, ctx] of one sequence's query rows (the Indexer.scores path)."""
    pos = torch.arange(ctx, device=pool.device)
    stored = dsa.gather_key_records(pool, fmt, layer, bt[seq, pos // pool.shape[2]], pos % pool.shape[2])
    q8, wf = dsa.quantize_queries(q, w)
    if fmt == "fp8":
        k8, ks = dsa.split_fp8_keys(stored)
        return dsa.index_scores_q(q8, wf, k8, ks)
    return dsa.index_scores_q(q8, wf, dsa.dequantize_mxfp4_keys(stored), None)


def assert_topk_sets_match(got: torch.Tensor, scores: torch.Tensor, qpos: torch.Tensor, k: int) -> None:
    """R1 contract: per row the selected sets are equal except among positions whose reference scores lie
    within 1e-3 (relative) of the k-th score."""
    for r in range(got.shape[0]):
        causal = scores[r, : int(qpos[r]) + 1]
        n = min(k, causal.numel())
        kth = torch.sort(causal, descending=True).values[n - 1]
        near = (causal - kth).abs() <= 1e-3 * kth.abs().clamp_min(1e-30)
        g = set(got[r][got[r] >= 0].tolist())
        assert len(g) == n, f"row {r}: {len(g)} positions selected, expected {n}"
        ref = set(torch.nonzero(causal > kth + 1e-3 * kth.abs()).flatten().tolist())
        assert ref <= g, f"row {r}: clearly better positions {sorted(ref - g)} were not selected"
        worse = [i for i in g if not bool(causal[i] >= kth or near[i])]
        assert not worse, f"row {r}: clearly worse positions {worse} were selected"
