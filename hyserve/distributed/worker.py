"""The rank side of a parallel engine (docs/parallelism.md, "Under the engine"): the functions each worker
process of the engine's rank pool (launch.RankPool) runs for it, in the same order on every rank.

A rank holds its slice of the model (read by the product loader with its StepContext), its own cache
tensors (its KDA heads' state slots; under DCP only its tokens' latent rows and index keys) and decode
graphs, and a ModelRunner over them: the single-process device path, unchanged. Each step it applies the
cache manager's queued copies to its own tensors, then runs the step from the inputs the engine built.
The logits are all-gathered inside the model, so every rank holds the same; rank 0 returns them.

State lives in this module per engine key, so one pool can serve several engines one after another.
"""

from __future__ import annotations

import dataclasses
import gc
from dataclasses import dataclass

import numpy as np
import torch

from hyserve.config import EngineConfig
from hyserve.distributed.capacity import RankCapacity, agree_on_counts
from hyserve.distributed.context import StepContext
from hyserve.distributed.groups import ParallelState
from hyserve.distributed.model import ParallelCausalLM
from hyserve.engine.cuda_graphs import DecodeGraphs
from hyserve.engine.kv_cache import CachePlan, plan_cache
from hyserve.engine.model_runner import ModelRunner
from hyserve.engine.step_inputs import StepInputs, StepLayout
from hyserve.models.batch import CacheTensors
from hyserve.models.loader import load_model


@dataclass
class StepMessage:
    """One step, as every rank receives it: the packed step-input buffer `build_step_inputs` made (ids
    resolved on the host), the host lists that go with it, and the cache copies queued since the last
    step, which a rank applies to its own tensors before the forward."""

    flat: np.ndarray
    layout: StepLayout
    query_lens: list[int]
    context_lens: list[int]
    sample_rows: list[int]
    prompt_rows: dict[int, int]
    graph: bool
    sequence_parallel: bool
    cache_ops: list[tuple[str, list[int], list[int]]]


@dataclass
class RankCache:
    """What a rank's ModelRunner and DecodeGraphs read of a cache manager. `block_size` is the
    scheduler's block (under DCP: the rank's page block times W)."""

    tensors: CacheTensors
    block_size: int
    scratch_block: int | None
    scratch_slot: int | None


@dataclass
class RankEngine:
    model: ParallelCausalLM
    plan: CachePlan | None = None
    cache: RankCache | None = None
    graphs: DecodeGraphs | None = None
    runner: ModelRunner | None = None


_ENGINES: dict[str, RankEngine] = {}


def load(state: ParallelState, key: str, cfg: EngineConfig) -> dict:
    """Load this rank's model; its dtype, kernel plan and load report for the engine's log."""
    torch.manual_seed(cfg.seed)
    model = load_model(cfg.model, dtype=cfg.dtype, device=state.device, seed=cfg.seed, load_format=cfg.load_format,
                       parallel=StepContext(state))
    _ENGINES[key] = RankEngine(model)
    return {"dtype": model.dtype, "kernel_plan": model.kernel_plan.table(), "load": model.load_report.describe()}


def plan(state: ParallelState, key: str, cfg: EngineConfig, dtype: torch.dtype, max_model_len: int,
         scratch: bool) -> tuple[CachePlan, str]:
    """This rank's cache plan from its own memory and shapes, then the smallest counts of all ranks (one
    block table and one slot table serve them all); with the capacity line of this rank."""
    eng, w = _ENGINES[key], state.dcp.size
    mine = plan_cache(cfg, eng.model, dtype, -(-max_model_len // w), scratch=scratch)  # a rank holds 1/W of a context
    blocks, slots, ckpt = agree_on_counts(state.tp, mine.num_blocks, mine.num_slots, mine.num_checkpoint_slots)
    eng.plan = dataclasses.replace(mine, num_blocks=blocks, num_slots=slots, num_checkpoint_slots=ckpt,
                                   block_size=cfg.block_size * w)
    capacity = RankCapacity(state.rank, blocks, cfg.block_size, w, slots, mine.page_bytes, mine.slot_bytes)
    return eng.plan, capacity.describe()


def allocate(state: ParallelState, key: str, dtype: torch.dtype) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Allocate this rank's cache tensors as planned; their shapes and dtypes."""
    eng = _ENGINES[key]
    p = eng.plan
    tensors = eng.model.make_cache(p.num_blocks, p.block_size // state.dcp.size, p.num_slots, dtype)
    eng.cache = RankCache(tensors, p.block_size, p.num_blocks - 1 if p.scratch else None,
                          p.num_slots - 1 if p.scratch else None)  # KVCacheManager's scratch page and slot
    return {f.name: (tuple(t.shape), t.dtype) for f in dataclasses.fields(tensors)
            if (t := getattr(tensors, f.name)) is not None}


def build_graphs(state: ParallelState, key: str, max_model_len: int, sizes: list[int], max_prev: int | None) -> None:
    eng = _ENGINES[key]
    graphs = DecodeGraphs(eng.model, eng.cache, max_model_len, sizes, max_prev)
    # sized from the model's config, which holds a rank's vocab rows; its logits are the whole vocabulary's
    graphs.logits = graphs.logits.new_zeros(graphs.logits.shape[0], eng.model.full_config.vocab_size)
    eng.graphs = graphs


def capture(state: ParallelState, key: str) -> list[tuple[int, int]]:
    """Capture this rank's decode graphs (CUDA only); the (batch size, tokens per row) captured."""
    eng = _ENGINES[key]
    eng.graphs.capture()
    return sorted(eng.graphs.graphs)


def step(state: ParallelState, key: str, msg: StepMessage) -> tuple[np.ndarray, dict[int, np.ndarray]] | None:
    """Apply the queued cache copies, run the step; rank 0 returns (logits, prompt logits) on the host."""
    eng = _ENGINES[key]
    if eng.runner is None:
        eng.runner = ModelRunner(eng.model, eng.cache, eng.graphs)
    for op, src, dst in msg.cache_ops:
        getattr(eng.cache.tensors, op)(src, dst)
    eng.model.ctx.sequence_parallel = msg.sequence_parallel
    inputs = StepInputs(torch.from_numpy(msg.flat), msg.layout, msg.query_lens, msg.context_lens, msg.sample_rows, False)
    out = eng.runner.run(inputs, None, msg.prompt_rows, msg.graph)
    eng.model.ctx.sequence_parallel = False  # graph capture and replay run without it
    if state.rank != 0:
        return None
    return out.logits.cpu().numpy(), {i: t.cpu().numpy() for i, t in out.prompt_logits.items()}


def release(state: ParallelState, key: str) -> None:
    """Drop an engine's rank (its pool goes on serving others)."""
    if _ENGINES.pop(key, None) is not None:
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
