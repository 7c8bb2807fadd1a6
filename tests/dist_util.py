"""Shared pieces of the parallelism tests: one gloo rank pool per world size for the whole test run
(workers start once; each call picks its layout), and a fixed multi-step scenario run through a model:
chunked prefill, decodes, and a one-token prompt (whose DCP shards are empty on all ranks but one)."""

from __future__ import annotations

import atexit
import time

import torch

from hyserve.distributed import ParallelConfig
from hyserve.distributed.launch import RankPool
from hyserve.models.batch import Batch

TIMEOUT_S = 60.0
_POOLS: dict[int, RankPool] = {}


def rank_pool(world: int) -> RankPool:
    pool = _POOLS.get(world)
    if pool is None or pool.broken:
        pool = _POOLS[world] = RankPool(ParallelConfig(tensor_parallel_size=world), timeout_s=TIMEOUT_S, threads=1)
        atexit.register(pool.close)
    return pool


def logits_error(state, preset: str, sequence_parallel: bool = False, dtype: str = "float32") -> float:
    """The rank model's worst relative logits error against one process over the scenario steps."""
    from hyserve.distributed.context import StepContext
    from hyserve.distributed.model import shard_model
    from hyserve.models.loader import load_model

    model = load_model(preset, dtype=dtype, device=state.device)
    ref, _ = run_steps(model)
    rank_model = shard_model(model, StepContext(state, sequence_parallel=sequence_parallel))
    got, _ = run_steps(rank_model, batch_block=PAGE_BLOCK * state.dcp.size)
    return max(rel_err(g.cpu(), r.cpu()) for g, r in zip(got, ref))


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """max |got - ref| / max |ref|."""
    return float((got.double() - ref.double()).abs().max() / ref.double().abs().max().clamp_min(1e-30))


# sequence -> (state slot, blocks); each step lists (sequence, new tokens); the first step of a sequence
# starts from a fresh state
SEQUENCES = {"A": (0, [0, 1, 2, 3]), "B": (1, [4, 5, 6]), "C": (2, [7])}
STEPS = [
    [("A", 8), ("B", 6)],  # two prefills
    [("A", 5), ("B", 1)],  # A's second chunk (rows at positions 8-12) beside a decode
    [("A", 1), ("B", 1)],
    [("C", 1), ("A", 1), ("B", 1)],  # a one-token prompt
]
PAGE_BLOCK = 4


def run_steps(model, batch_block: int = PAGE_BLOCK, seed: int = 0) -> tuple[list[torch.Tensor], object]:
    """(fp32 logits of every token of every step, the cache after the last). `batch_block` is the block
    size the block tables are built for (a DCP rank's pages hold PAGE_BLOCK of its own tokens, which are
    PAGE_BLOCK * W of the sequence's)."""
    gen = torch.Generator().manual_seed(seed)
    vocab = getattr(model, "full_config", model.config).vocab_size
    tokens = {s: torch.randint(0, vocab, (32,), generator=gen) for s in SEQUENCES}
    cache = model.make_cache(8, PAGE_BLOCK, len(SEQUENCES))
    done = dict.fromkeys(SEQUENCES, 0)
    out = []
    for step in STEPS:
        names = [s for s, _ in step]
        qlens = [n for _, n in step]
        ctx = [done[s] + n for s, n in step]
        ids = torch.cat([tokens[s][done[s] : done[s] + n] for s, n in step])
        batch = Batch.build(qlens, ctx, [SEQUENCES[s][1] for s in names], batch_block,
                            [SEQUENCES[s][0] for s in names], [done[s] == 0 for s in names])
        out.append(model.compute_logits(model(ids, batch, cache)))
        for s, n in step:
            done[s] += n
    return out, cache


# ---- engines over a shared pool -------------------------------------------------------------------------
# Engines of a layout run on the pool of its size: the ranks' processes start once per test run, and each
# engine's ranks load, plan and allocate on them (a few tenths of a second for the tiny presets).

ENGINE_DEFAULTS = dict(device="cpu", kv_cache_memory_bytes=4 << 20, max_num_seqs=8, load_format="dummy")


def parallel_engine(preset: str, world: int = 1, static_decode_buffers: bool = False, **fields):
    """An LLMEngine of `preset` (token-id prompts, no tokenizer) on `world` ranks of the shared pool, or on
    one process for world 1."""
    from hyserve.config import EngineConfig
    from hyserve.distributed.executor import RankWorkers
    from hyserve.engine.llm_engine import LLMEngine

    cfg = EngineConfig(model=preset, tensor_parallel_size=world, **{**ENGINE_DEFAULTS, **fields})
    model = RankWorkers(cfg, "cpu", pool=rank_pool(world)) if world > 1 else None
    return LLMEngine(cfg, model=model, skip_tokenizer_init=True, static_decode_buffers=static_decode_buffers)


class LogitsRecorder:
    """Records the logits every step of an engine hands its sampler (and the prompt logits), around the
    engine's own runner."""

    def __init__(self, engine):
        self.steps: list[torch.Tensor] = []
        self._execute = engine.runner.execute
        engine.runner.execute = self

    def __call__(self, out, pending=None):
        got = self._execute(out, pending)
        self.steps.append(torch.cat([got.logits.float().cpu(), *(p.float().cpu() for p in got.prompt_logits.values())]))
        return got


def worst_step_error(got: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    assert [g.shape for g in got] == [r.shape for r in ref], "the engines scheduled different steps"
    return max(rel_err(g, r) for g, r in zip(got, ref) if r.numel())


def _gone(pid: int) -> bool:
    """The process has exited (a zombie counts: whoever reaps it is not ours to wait for)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return any(line.startswith("State:") and "zombie" in line.lower() for line in f)
    except OSError:
        return True


def all_exit(pids: list[int], within_s: float = 15.0) -> bool:
    deadline = time.monotonic() + within_s
    while not all(map(_gone, pids)):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True
