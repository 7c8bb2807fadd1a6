"""The warm start: before "ready", run the prefill and mixed-step shapes of a token-count ladder through
the real forward, so Triton compiles and autotunes every kernel those steps launch and no request pays
for it (a first 1,024-token request on the 48B waited 44 s). Decode steps are then captured in CUDA
graphs as before, which compiles the decode kernels at every ladder batch size.

The shapes (`plan_warmup`), for each token count T of the ladder (powers of two from 2 up to the step
budget, and the budget itself):
  - a fresh prefill of T tokens, and one of T - 1 (what prefix caching computes first of a T-token prompt:
    an odd count, which Triton compiles apart);
  - a chunk of T tokens over a cached context (KDA from a state, MLA with the causal offset);
  - a mixed step of T tokens: a chunk over a cached context beside one decode of a long context, and
    beside as many decodes of a short context as the step and the running set allow.
Decode-only steps at the graph ladder's batch sizes (long and short contexts) are added when no decode
graphs will be captured (`--enforce-eager`): eager decodes compile on first use too. With speculative
decoding, verify steps of every draft count k (1 + k tokens a sequence: the KDA verify kernel compiles per
row length) at one sequence and at the most the slots allow, over a short and a long context; verify steps
run eagerly, graphs or not. Contexts stay within max_model_len and the pages the pool can lend.
Then the MLA layers' fresh-prompt attention runs once at each length of its ladder (`ops.mla_fresh`), so
cuDNN has built the plan of every length a fresh prompt is padded to.
Between the ladder's counts, kernels that tune per bucket of their size get one fresh prefill per bucket the
ladder misses (`_bucket_steps`: fla's q/k L2 norm in the KDA prefill, a 6,144-token step on the 48B shape).

The steps run on pages and running state slots lent by the cache manager's pools and given back in the
order taken, so the pools are exactly as they were (only the lent rows' contents change, and nothing reads
a row before writing it: requests start fresh or from a prefix hit). All sequences of a step share the lent
pages: their values do not matter, their shapes do. Token ids are a fixed arithmetic sequence and nothing is
sampled, so no random generator advances and every later output is what an engine without the warm-up
gives.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from hyserve.config import EngineConfig
from hyserve.engine.cuda_graphs import graph_batch_sizes
from hyserve.engine.kv_cache import KVCacheManager
from hyserve.engine.model_runner import ModelRunner
from hyserve.engine.request import Request
from hyserve.engine.scheduler import ScheduledSeq, SchedulerOutput
from hyserve.sampling_params import SamplingParams
from hyserve.startup import StartupClock

log = logging.getLogger(__name__)
VERIFY = -1  # the rung of the verify steps
# fla's l2norm_fwd (q and k of every KDA prefill) autotunes per cdiv(rows, 2048 * 32), rows = tokens x heads:
# the powers-of-two ladder reaches buckets 1, 2, 4, ... and a step between them tuned 25 variants on first use
FLA_L2NORM_ROWS = 2048 * 32


@dataclass(frozen=True)
class WarmupStep:
    query_lens: tuple[int, ...]  # per sequence: tokens computed in the step
    context_lens: tuple[int, ...]  # per sequence: its length after the step
    label: str
    rung: int  # the ladder's token count this step belongs to (0: eager decodes, VERIFY: verify steps)
    drafts: int = 0  # verify steps: every sequence verifies this many drafts after its last token

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)


def token_ladder(budget: int) -> list[int]:
    """2, 4, 8, ... below the budget, then the budget itself."""
    out, t = [], 2
    while t < budget:
        out.append(t)
        t *= 2
    return out + [budget] if budget >= 2 else out


def rung_steps(t: int, longest: int, seqs: int, short: int) -> list[WarmupStep]:
    """The steps of token count t (`longest`: the longest sequence allowed, `seqs`: the most sequences)."""
    steps = []
    fresh = [min(longest, t - i) for i in range(0, t, longest)][:seqs]
    steps.append(WarmupStep(tuple(fresh), tuple(fresh), f"prefill {t}", t))
    if 4 <= t <= longest:
        # under prefix caching a t-token prompt computes t - 1 tokens first (its checkpoint at prompt_len - 1):
        # an odd count, which Triton compiles apart from even ones (it specializes integer arguments, and
        # counts derived from them such as the token-expert pairs, on their divisibility by 16)
        steps.append(WarmupStep((t - 1,), (t - 1,), f"prefill {t - 1}", t))
    if t < longest:
        cached = min(t, longest - t)
        steps.append(WarmupStep((t,), (cached + t,), f"prefill {t} over {cached} cached", t))
    for d, ctx in ((1, longest), (min(seqs - 1, t // 2), short)):
        q = t - d
        if d < 1 or d + 1 > seqs or q < 2 or q >= longest:  # the chunk's sequence needs a slot of its own
            continue
        cached = min(q, longest - q)
        label = f"prefill {q} over {cached} cached + {d} decode{'s' * (d > 1)} over {ctx}"
        steps.append(WarmupStep((q, *[1] * d), (cached + q, *[ctx] * d), label, t))
    return steps


def plan_warmup(cfg: EngineConfig, max_model_len: int, kv: KVCacheManager, decode_graphs: bool,
                kda_heads: int = 0) -> list[WarmupStep]:
    """The steps the warm-up runs for the resolved `cfg`, within what `kv`'s pools can lend now
    (`kda_heads`: the KDA layers' heads, 0 for a model without them)."""
    longest = min(max_model_len, kv.blocks.num_free * kv.block_size)
    seqs = min(cfg.max_num_seqs, kv.slots.num_free)
    if longest < 2 or seqs < 1:
        return []
    short = min(longest, kv.block_size + 1)
    steps = [s for t in token_ladder(cfg.max_num_batched_tokens) for s in rung_steps(t, longest, seqs, short)]
    steps += _bucket_steps(steps, cfg.max_num_batched_tokens, kda_heads, longest, seqs)
    if not decode_graphs:
        for n in graph_batch_sizes(min(seqs, cfg.max_num_batched_tokens)):
            steps += [WarmupStep((1,) * n, (ctx,) * n, f"{n} decodes over {ctx}", 0) for ctx in sorted({short, longest})]
    return steps + verify_steps(cfg, kv, longest, seqs, short)


def prefill_tokens(step: WarmupStep) -> int:
    """The tokens of the step's prefill chunks (what one varlen KDA prefill call computes)."""
    if step.drafts:
        return 0
    return sum(q for q, n in zip(step.query_lens, step.context_lens) if q > 1 or q == n)


def _bucket_steps(steps: list[WarmupStep], budget: int, kda_heads: int, longest: int, seqs: int) -> list[WarmupStep]:
    """A fresh prefill for each fla L2-norm bucket a step of the budget can reach and `steps` do not."""
    if kda_heads < 1:
        return []
    bucket = lambda tokens: -(-tokens * kda_heads // FLA_L2NORM_ROWS)  # noqa: E731
    seen, extra = {bucket(prefill_tokens(s)) for s in steps}, []
    for nb in range(1, bucket(budget) + 1):
        t = min(budget, nb * FLA_L2NORM_ROWS // kda_heads, longest * seqs)  # the bucket's largest count
        if nb in seen or bucket(t) != nb:
            continue
        fresh = tuple(min(longest, t - i) for i in range(0, t, longest))
        extra.append(WarmupStep(fresh, fresh, f"prefill {t} (L2-norm bucket {nb})", t))
    return extra


def verify_steps(cfg: EngineConfig, kv: KVCacheManager, longest: int, seqs: int, short: int) -> list[WarmupStep]:
    """Verify steps of every draft count (speculative decoding only): each sequence takes a row of
    `kv.spec_width` state slots."""
    if cfg.speculative_config is None:
        return []
    width = kv.spec_width
    most = min(seqs, kv.slots.num_free // width)
    steps = []
    for k in range(1, width if most else 1):  # the engine refuses 1 + K over the token budget
        for n in sorted({1, min(most, cfg.max_num_batched_tokens // (1 + k))}):
            for ctx in sorted({max(short, k + 2), longest}):
                if ctx <= longest:  # a verify row continues a sequence: its context holds 1 + k and more
                    steps.append(WarmupStep((1 + k,) * n, (ctx,) * n, f"{n} verify rows of 1 + {k} over {ctx}",
                                            VERIFY, drafts=k))
    return steps


def _ids(n: int, vocab: int) -> list[int]:
    return [(7 + 31 * i) % vocab for i in range(n)]


def run_warmup(model, kv: KVCacheManager, steps: list[WarmupStep], clock: StartupClock | None = None) -> float:
    """Run `steps` eagerly, as the engine runs prefill and mixed steps; returns the seconds taken, which
    `clock` also books as the start-up phase "warm-up"."""
    try:
        return _run(model, kv, steps)
    finally:
        if clock is not None:
            clock.lap("warm-up")


def _run(model, kv: KVCacheManager, steps: list[WarmupStep]) -> float:
    if not steps:
        return 0.0
    seconds = run_steps(model, kv, steps)
    _fresh_plans(model, max(s.num_tokens for s in steps))
    return seconds


def run_steps(model, kv: KVCacheManager, steps: list[WarmupStep], name: str = "warm-up") -> float:
    """Run `steps` eagerly through a model runner on pages and slots lent by `kv` (given back after, in
    the order taken); returns the seconds taken. `name` heads the progress lines."""
    t0, runner, vocab = time.perf_counter(), ModelRunner(model, kv), model.config.vocab_size
    pages = kv.blocks.allocate(-(-max(max(s.context_lens) for s in steps) // kv.block_size))
    slots = [kv.slots.allocate() for _ in range(max(len(s.query_lens) * (kv.spec_width if s.drafts else 1)
                                                    for s in steps))]
    try:
        for i, step in enumerate(steps):
            runner.execute(SchedulerOutput([_seq(step, i, j, pages, slots, kv, vocab) for j in range(len(step.query_lens))]))
            log.debug("%s step %d/%d: %s", name, i + 1, len(steps), step.label)
            if i + 1 == len(steps) or steps[i + 1].rung != step.rung:
                if model.device.type == "cuda":
                    torch.cuda.synchronize(model.device)
                what = {0: "eager decodes", VERIFY: "verify steps"}.get(step.rung, f"{step.rung} tokens")
                log.info("%s: %s done (%d/%d steps, %.1f s)", name, what, i + 1, len(steps), time.perf_counter() - t0)
    finally:
        kv.blocks.free(pages)
        for s in reversed(slots):
            kv.slots.free(s)
    return time.perf_counter() - t0


def _fresh_plans(model, max_tokens: int) -> None:
    """cuDNN's plans for every fresh-prompt length rung of the MLA layers (`ops.mla_fresh`)."""
    from hyserve.models.layers.mla import MLAttention
    from hyserve.ops.mla_fresh import build_fresh_plans, pads_fresh

    mla = next((m for m in model.modules() if isinstance(m, MLAttention)), None)
    if mla is not None and pads_fresh(w := mla.kv_b_proj.weight):
        seconds = build_fresh_plans(mla.num_heads, mla.dn + mla.dr, w.dtype, w.device, max_tokens)
        log.info("warm-up: fresh-prompt attention plans up to %d tokens (%.1f s)", max_tokens, seconds)


def _seq(step: WarmupStep, i: int, j: int, pages: list[int], slots: list[int], kv: KVCacheManager,
         vocab: int) -> ScheduledSeq:
    """Sequence j of warm-up step i on the lent pages and slots; a verify row holds the tokens up to its
    last one and verifies `step.drafts` more, from column 0 of its own row of slots."""
    q, n, k = step.query_lens[j], step.context_lens[j], step.drafts
    req = Request(f"warmup-{i}-{j}", _ids(n - k, vocab), SamplingParams(), max_tokens=1)
    req.block_ids = pages[: -(-n // kv.block_size)]
    if not k:
        req.state_slot = slots[j]
        return ScheduledSeq(req, q, n - q, fresh=n == q)
    req.spec_slots = slots[j * kv.spec_width : (j + 1) * kv.spec_width]
    req.state_slot = req.spec_slots[0]
    return ScheduledSeq(req, q, n - q, fresh=False, draft_ids=_ids(k, vocab))
