"""The profile run: how much device memory the engine's largest steps take beside the weights and the cache,
measured before the cache is sized (vLLM's profile run; docs/ARCHITECTURE.md, "Memory plan").

Without it the cache took all free memory but (1 - gpu_memory_utilization) of the card, and whatever a step
allocates (activations, the expanded MLA keys of a chunk over a cached context, kernel workspaces, the
sampler's sorted logits) had to fit in that margin beside the CUDA graphs' pools. A 44.6 GB model on an
80 GB card (a 7.9 GiB margin) ran out of memory in a 32-request prefill step once the graphs had taken
their share. Now the cache gets total x gpu_memory_utilization minus what is in use after loading minus
the profiled peak, and the margin is left to the graphs' private pools, fragmentation and other processes.

The profiled steps are the warm-up's steps of the full token budget (a fresh prefill, a chunk over a cached
context, mixed steps beside decodes; planning/warmup.py), a chunk of the budget at the end of a context of
MAX_EXPANDED_ROWS (the most cached rows an MLA prefill expands at once, ops/mla_decode.py) and, when
speculating, its largest verify step, run eagerly on a small cache of their own that is freed again. Then
the sampler runs once over as many rows as a step can sample, with the sampling features that allocate the
most (penalties, top-k/top-p, logprobs).
The peak is torch's allocator high-water mark above what was in use before the run (the small cache not
counted): what the default pool must be able to hand out.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import time
from dataclasses import dataclass

import torch

from hyserve.config import EngineConfig
from hyserve.engine.kv_cache import KVCacheManager, plan_cache, state_row_width
from hyserve.engine.sampler import Sampler, SamplingMetadata
from hyserve.ops.mla_decode import MAX_EXPANDED_ROWS
from hyserve.planning.warmup import WarmupStep, run_steps, rung_steps, verify_steps
from hyserve.sampling_params import SamplingParams

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MemoryProfile:
    in_use_bytes: int  # torch's allocations before the run: the weights and buffers
    peak_bytes: int  # the most the profiled steps and the sampler allocated on top of that
    num_steps: int
    seconds: float

    def describe(self) -> str:
        gib = 1 << 30
        return (f"memory profile: weights and buffers {self.in_use_bytes / gib:.2f} GiB; the largest steps' peak "
                f"{self.peak_bytes / gib:.2f} GiB over {self.num_steps} steps and the sampler ({self.seconds:.1f} s)")


def profile_contexts(cfg: EngineConfig, max_model_len: int, block_size: int) -> tuple[int, int, int]:
    """(longest context, most sequences, shortest context) the profiled steps use: contexts up to the most
    cached rows an MLA prefill expands at once (MAX_EXPANDED_ROWS) or twice the token budget, within
    max_model_len."""
    budget = cfg.max_num_batched_tokens
    longest = min(max_model_len, max(2 * budget, MAX_EXPANDED_ROWS))
    return longest, min(cfg.max_num_seqs, budget), min(longest, block_size + 1)


def profile_steps(cfg: EngineConfig, kv: KVCacheManager, max_model_len: int) -> list[WarmupStep]:
    """The warm-up's steps of the full token budget and its largest verify step (speculating only), on what
    `kv`'s pools can lend."""
    longest, seqs, short = profile_contexts(cfg, max_model_len, kv.block_size)
    longest = min(longest, kv.blocks.num_free * kv.block_size)
    seqs = min(seqs, kv.slots.num_free)
    if longest < 2 or seqs < 1:
        return []
    budget = cfg.max_num_batched_tokens
    steps = rung_steps(budget, longest, seqs, short)
    if 2 * budget < longest:  # a chunk at the end of a long prompt: the MLA layers' largest expansion
        steps.append(WarmupStep((budget,), (longest,), f"prefill {budget} over {longest - budget} cached", budget))
    verify = verify_steps(cfg, kv, longest, seqs, short)
    if verify:
        steps.append(max(verify, key=lambda s: (s.num_tokens, max(s.context_lens))))
    return steps


def sampler_rows(cfg: EngineConfig) -> int:
    """The most rows one step samples: every sequence's verify row (1 + drafts), within the token budget."""
    return max(1, min(cfg.max_num_seqs * state_row_width(cfg), cfg.max_num_batched_tokens))


def profile_memory(cfg: EngineConfig, model, cache_dtype: torch.dtype, max_model_len: int) -> MemoryProfile | None:
    """The profile of `model` under the resolved `cfg` (CUDA only; None elsewhere, or when the cache's size
    is given in bytes or blocks and no plan depends on the peak)."""
    if model.device.type != "cuda" or cfg.kv_cache_memory_bytes is not None or cfg.num_gpu_blocks is not None:
        return None
    t0, device = time.perf_counter(), model.device
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.synchronize(device)
    in_use = torch.cuda.memory_allocated(device)
    kv = _small_cache(cfg, model, cache_dtype, max_model_len)
    cache_bytes = torch.cuda.memory_allocated(device) - in_use
    torch.cuda.reset_peak_memory_stats(device)
    steps = profile_steps(cfg, kv, max_model_len)
    try:
        run_steps(model, kv, steps, name="memory profile")
        _sample(cfg, model)
        torch.cuda.synchronize(device)
        peak = max(0, torch.cuda.max_memory_allocated(device) - in_use - cache_bytes)
    finally:
        del kv
        gc.collect()
        torch.cuda.empty_cache()
    profile = MemoryProfile(in_use, peak, len(steps), time.perf_counter() - t0)
    log.info(profile.describe())
    return profile


def _small_cache(cfg: EngineConfig, model, cache_dtype: torch.dtype, max_model_len: int) -> KVCacheManager:
    """A cache of just the pages and state slots the profiled steps take (no prefix cache, no scratch)."""
    longest, seqs, _ = profile_contexts(cfg, max_model_len, cfg.block_size)
    # the block and slot counts size it: the byte budget (no mem_get_info) is only a placeholder
    small = dataclasses.replace(cfg, enable_prefix_caching=False, num_gpu_blocks=-(-longest // cfg.block_size),
                                num_state_slots=seqs * state_row_width(cfg), kv_cache_memory_bytes=1)
    return KVCacheManager(small, model, plan_cache(small, model, cache_dtype, longest), cache_dtype)


def _sample(cfg: EngineConfig, model) -> None:
    """The sampler over the most rows a step samples, with penalties, top-k/top-p and logprobs on."""
    rows, vocab, device = sampler_rows(cfg), model.config.vocab_size, model.device
    params = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, presence_penalty=0.5, repetition_penalty=1.1,
                            logprobs=1)
    history = [[7, 8, 9]] * rows
    meta = SamplingMetadata.build([params] * rows, history, history, [None] * rows, device, [], vocab)
    logits = torch.randn(rows, vocab, device=device, dtype=torch.float32)
    Sampler()(logits, meta)
