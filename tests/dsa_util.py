"""Shared by the DSA tests: run a model over sequences split into arbitrary steps through the paged cache."""

from __future__ import annotations

import torch

from hyserve.models.batch import Batch


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
