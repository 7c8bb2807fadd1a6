"""The training forward: B sequences laid end to end through the engine's own model forward.

Each sequence starts from a fresh KDA state and gets its own scratch pages, so one call is exactly the
prefill the server would run for each of them. Under the training plan (`KernelPlan.for_training`, passed
as `plan`) three layers take batched, differentiable paths with no per-sequence Python loop and no host
synchronisation:
  - KDA (CUDA + fla-core): fla `chunk_kda` varlen over the whole step (`KimiDeltaAttention.train_forward`;
    the serving fast path merges weights detached and writes states, so it cannot train);
  - MLA (any device, rows of equal length): one causal SDPA over [rows, heads, row_len, dim], which is
    flash attention on the GPU, instead of one call per sequence over the paged cache;
  - MoE: every expert on every token, weighted by the router's (mostly zero) weights (`dense_experts`):
    static shapes and no `.tolist()` of expert counts; at this model size the extra expert FLOPs are cheap.
Each is the same function as the layer's reference forward (tests/test_train.py checks it on the CPU).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from hyserve.models.batch import Batch, CacheTensors
from hyserve.models.kimi import KimiForCausalLM
from hyserve.ops.kernel_plan import KernelPlan
from hyserve.train.rows import IGNORE, RowBatch

BLOCK_SIZE = 64


def pack(seqs: Sequence[Sequence[int]], device: torch.device, block_size: int = BLOCK_SIZE) -> tuple[torch.Tensor, Batch]:
    """Flattened ids and a Batch of whole sequences, each in consecutive blocks and its own state slot."""
    lens = [len(s) for s in seqs]
    tables, nxt = [], 0
    for n in lens:
        blocks = -(-n // block_size)
        tables.append(list(range(nxt, nxt + blocks)))
        nxt += blocks
    batch = Batch.build(lens, lens, tables, block_size, list(range(len(seqs))), [True] * len(seqs), device)
    ids = torch.tensor([t for s in seqs for t in s], dtype=torch.long, device=device)
    return ids, batch


def row_batch(rows: int, row_len: int, device: torch.device, block_size: int = BLOCK_SIZE) -> Batch:
    """The constant Batch of a fixed-shape step: `rows` fresh sequences of `row_len` tokens."""
    per = -(-row_len // block_size)
    tables = [list(range(i * per, (i + 1) * per)) for i in range(rows)]
    return Batch.build([row_len] * rows, [row_len] * rows, tables, block_size, list(range(rows)), [True] * rows,
                       device)


def scratch_cache(model: KimiForCausalLM, batch: Batch, block_size: int = BLOCK_SIZE) -> CacheTensors:
    blocks = int(batch.block_tables.max()) + 1
    return model.make_cache(blocks, block_size, batch.num_seqs)


def trim_autotuners(module_prefix: str, max_configs: int) -> int:
    """Keep the `max_configs` lightest configs (fewest pipeline stages, then warps nearest 4) of every
    Triton autotuner in the imported modules under `module_prefix`; returns how many were trimmed.
    Fewer stages means less shared memory, so the configs kept are the ones least likely to fail to
    launch, and keeping two lets the autotuner still time (and survive) a bad one."""
    import sys

    from triton.runtime.autotuner import Autotuner

    trimmed = 0
    for name, module in list(sys.modules.items()):
        if not name.startswith(module_prefix) or module is None:
            continue
        for obj in list(vars(module).values()):
            while obj is not None and not isinstance(obj, Autotuner) and hasattr(obj, "fn"):
                obj = obj.fn  # @triton.heuristics wraps the autotuner
            if isinstance(obj, Autotuner) and len(obj.configs) > max_configs:
                obj.configs = sorted(obj.configs, key=lambda c: (c.num_stages, abs(c.num_warps - 4)))[:max_configs]
                trimmed += 1
    return trimmed


def limit_fla_autotune(max_configs: int) -> int:
    """`trim_autotuners` over fla-core. Its chunk_kda forward and backward compile and time every config
    of every kernel before the first step: about four minutes on an H200 for the embedded model, more
    than the training steps that fit in one device call (38 s with two configs each)."""
    import fla.ops.kda  # noqa: F401 - imports the kernels to trim

    return trim_autotuners("fla.", max_configs)


def row_lm_loss(model: KimiForCausalLM, rb: RowBatch, batch: Batch, cache: CacheTensors,
                plan: KernelPlan | None = None) -> torch.Tensor:
    """Mean next-token loss of a fixed-shape step (`batch` from `row_batch`): static shapes end to end,
    no host synchronisation (the targets carry IGNORE where nothing is trained). `plan`: the model's
    kernels by default; the trainer passes the training plan."""
    dev = model.device
    hidden = model(rb.ids.to(dev, non_blocking=True), batch, cache, plan)
    logits = model.lm_head(hidden).float()
    return F.cross_entropy(logits, rb.targets.to(dev, non_blocking=True), ignore_index=IGNORE)


def packed_hidden(model: KimiForCausalLM, seqs: Sequence[Sequence[int]], plan: KernelPlan | None = None) -> torch.Tensor:
    """Final hidden states [sum(len), D] of `seqs`, each run from an empty state."""
    ids, batch = pack(seqs, model.device)
    return model(ids, batch, scratch_cache(model, batch), plan)


def masked_lm_loss(
    model: KimiForCausalLM, seqs: Sequence[Sequence[int]], masks: Sequence[Sequence[int]],
    plan: KernelPlan | None = None,
) -> tuple[torch.Tensor, int]:
    """Mean next-token loss over targets whose mask is 1, and the number of such targets.

    Token j of a sequence predicts token j+1; the target's own mask decides (assistant-only for chat).
    """
    hidden = packed_hidden(model, seqs, plan)
    src, tgt, start = [], [], 0
    for s, m in zip(seqs, masks):
        for j in range(len(s) - 1):
            if m[j + 1]:
                src.append(start + j)
                tgt.append(s[j + 1])
        start += len(s)
    dev = hidden.device
    src_t = torch.tensor(src, dtype=torch.long, device=dev)
    tgt_t = torch.tensor(tgt, dtype=torch.long, device=dev)
    logits = model.lm_head(hidden[src_t]).float()
    return F.cross_entropy(logits, tgt_t), len(tgt)
