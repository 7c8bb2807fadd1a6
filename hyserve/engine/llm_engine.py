"""add_request / abort / step: the engine loop (docs/ARCHITECTURE.md, "Engine loop").

A step schedules, launches the forward and the sampler, reads the sampled tokens back, applies them
(logprobs, detokenizing, stop checks) and emits each touched request's delta. `step_deltas()` hands the
deltas out as they are; `step()` shapes them into `RequestOutput`s by each request's output_kind.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass

import torch

from hyserve import compile_cache
from hyserve.config import EngineConfig, log_startup, resolve_config
from hyserve.distributed.executor import RankGraphs, RankRunner, RankWorkers
from hyserve.engine.cuda_graphs import DecodeGraphs, graph_batch_sizes, verify_graph_sizes
from hyserve.engine.engine_core import EngineDeadError
from hyserve.engine.kv_cache import KVCacheManager, plan_cache
from hyserve.engine.model_runner import ModelRunner
from hyserve.engine.output_processor import CompletionState, ParentRequest, check_stop
from hyserve.engine.phases import phase, phased
from hyserve.engine.readback import Readback
from hyserve.engine.request import Request, RequestStatus
from hyserve.engine.sampler import (
    Sampler,
    SamplerOutput,
    SamplingMetadata,
    compute_prompt_logprobs,
    grammar_mask,
    logprob_dicts,
)
from hyserve.engine.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from hyserve.engine.step_inputs import PendingTokens
from hyserve.engine.step_times import StepTimes
from hyserve.models import segment_graphs
from hyserve.models.loader import load_model, resolve_dtype
from hyserve.models.segment_graphs import segment_graph_sizes
from hyserve.outputs import Logprob, OutputAccumulator, RequestDelta, RequestOutput
from hyserve.planning import compile_watch
from hyserve.planning.memory_profile import profile_memory
from hyserve.planning.warmup import plan_warmup, run_warmup
from hyserve.sampling_params import SamplingParams
from hyserve.spec_decode.engine_step import make_decoder
from hyserve.spec_decode.reference_loop import SpecStats
from hyserve.startup import StartupClock, describe_startup, since_process_start
from hyserve.tokenizer import Tokenizer, load_tokenizer, parse_prompt, tokenizer_source

log = logging.getLogger(__name__)


_Emitted = tuple[ParentRequest, RequestDelta]


@dataclass
class _Launched:
    """A step whose forward and sampling are queued on the device; its tokens are not read back yet."""

    out: SchedulerOutput
    reqs: list[Request]  # the requests that sample, in the sampler's row order
    result: SamplerOutput | None  # None when no sequence samples (prefill chunks only)
    now: float
    readback: Readback | None = None  # the result's host copies, queued behind the sampler
    verify: list[ScheduledSeq] | None = None  # a step with drafts: its sampling sequences (rejection sampled)
    kind: str = "eager"  # how it ran (StepTimes' kinds)
    launched: float = 0.0  # perf_counter seconds


def _needs_host_tokens(req: Request) -> bool:
    """Whether the request's next sampling needs its previous token on the host."""
    return req.params.has_penalties or req.params.structured is not None


@dataclass
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_preemptions: int = 0
    prompt_tokens: int = 0  # every prompt token once per request, cached or computed (vLLM's meaning)
    prompt_tokens_cached: int = 0  # of those, served from the prefix cache (local or CPU tier)
    prompt_tokens_external: int = 0  # of the cached ones, restored from the CPU tier
    generation_tokens: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    last_step_tokens: int = 0
    spec_decode: SpecStats | None = None  # speculative decoding's counters (None when it is off)
    kernels_compiled_after_ready: int = 0  # Triton variants built while requests waited (planning/compile_watch.py)
    steps: StepTimes = dataclasses.field(default_factory=StepTimes)


@dataclass
class StepStats:
    """What one engine step computed: the step whose results a `step()` call read back (under async
    scheduling, the one the call before launched). A public seam for benchmarks and stat loggers."""

    num_seqs: int = 0
    num_prompt_tokens: int = 0  # prompt tokens computed (prefill chunks)
    num_decode_tokens: int = 0  # tokens computed past the prompts

    @classmethod
    def of(cls, out: SchedulerOutput) -> StepStats:
        prompt = sum(max(0, min(s.end, s.req.num_prompt_tokens) - s.start) for s in out.seqs)
        return cls(len(out.seqs), prompt, out.num_tokens - prompt)


class LLMEngine:
    def __init__(
        self, cfg: EngineConfig, model=None, tokenizer: Tokenizer | None = None, *, static_decode_buffers: bool = False,
        skip_tokenizer_init: bool = False,
    ):
        """Decode steps replay CUDA graphs unless the resolved config says `enforce_eager` (always on the
        CPU). `static_decode_buffers` runs them through the graphs' static, padded buffers whatever the
        config says; on the CPU nothing is captured: the path's tests use it. `skip_tokenizer_init`
        (vLLM's): load no tokenizer; prompts are token ids and outputs carry token ids, with empty text."""
        with compile_watch.watch().starting():  # what compiles from here to ready is the start's own
            self._start(cfg, model, tokenizer, static_decode_buffers, skip_tokenizer_init)
        self._compiled_at_ready = compile_watch.watch().after_ready

    def _start(self, cfg: EngineConfig, model, tokenizer: Tokenizer | None, static_decode_buffers: bool,
               skip_tokenizer_init: bool) -> None:
        self.startup = StartupClock()
        device = cfg.device or ("cuda" if torch.cuda.is_available() else "cpu")
        torch.manual_seed(cfg.seed)
        if model is None and cfg.tensor_parallel_size > 1:  # the ranks load their slices (docs/parallelism.md)
            model = RankWorkers(cfg, device)
        self.model = model if model is not None else load_model(
            cfg.model, dtype=cfg.dtype, device=device, seed=cfg.seed, load_format=cfg.load_format)
        self.startup.lap("load")
        self.model_config = self.model.config
        self.device = self.model.device
        # the one resolution of the defaults left open (docs/ARCHITECTURE.md §6); the engine reads only this
        self.cfg = cfg = resolve_config(cfg, str(self.device), str(self.model.dtype).removeprefix("torch."),
                                        self.model_config.max_position_embeddings, model_config=self.model_config,
                                        device_name=self.model.kernel_plan.device.name)
        log_startup(cfg, self.model.kernel_plan)
        self.tokenizer = tokenizer
        if tokenizer is None and not skip_tokenizer_init:
            self.tokenizer = load_tokenizer(tokenizer_source(cfg.model, cfg.tokenizer, cfg.load_format),
                                            self.model_config.tokenizer_family)
        limit = self.model_config.max_position_embeddings
        self.max_model_len = min(cfg.max_model_len or limit, limit)
        cache_dtype = self.model.dtype if cfg.kv_cache_dtype == "auto" else resolve_dtype(cfg.kv_cache_dtype, self.model_config)
        cuda_graphs = static_decode_buffers or not cfg.enforce_eager
        self.startup.lap()
        # ranks size their caches themselves (distributed/worker.py)
        self.memory_profile = profile = None if isinstance(self.model, RankWorkers) else profile_memory(
            cfg, self.model, cache_dtype, self.max_model_len)
        if profile is not None:
            self.startup.lap("memory profile")
        self.cache_plan = plan_cache(cfg, self.model, cache_dtype, self.max_model_len, scratch=cuda_graphs,
                                     activation_bytes=profile.peak_bytes if profile is not None else 0)
        log.info(self.cache_plan.describe())
        self.kv = KVCacheManager(cfg, self.model, self.cache_plan, cache_dtype)
        self.scheduler = Scheduler(cfg, self.kv)
        self.startup.lap("cache allocation")
        if cfg.warmup and not isinstance(self.model, RankWorkers):  # ranks warm up only on their first steps
            # kernels compiled and tuned before ready; before the graphs take what memory is left
            heads = self.model_config.kda_num_heads if self.model_config.kda_layers else 0
            plan = plan_warmup(cfg, self.max_model_len, self.kv, cuda_graphs, kda_heads=heads)
            run_warmup(self.model, self.kv, plan, self.startup)
        spec = cfg.speculative_config
        self.spec = None if spec is None else make_decoder(spec, self.max_model_len, self.model, self.scheduler)
        self.runner = self._runner(cuda_graphs, getattr(self.spec, "feature_layers", None))
        self.sampler = Sampler()
        tokenizer_eos = [self.tokenizer.eos_token_id] if self.tokenizer is not None else []
        self.eos_token_ids = list(self.model_config.eos_token_ids) or tokenizer_eos
        self.parents: dict[str, ParentRequest] = {}
        self.stats = EngineStats(spec_decode=self.spec.stats if self.spec is not None else None)
        self._landed: SchedulerOutput | None = None  # the step the last step() call read back
        self._in_flight: _Launched | None = None  # async scheduling: the step whose tokens are on the device
        self._stashed: list[_Emitted] = []  # deltas of a step read back early (an abort)
        log.info("engine %s; %.1f s after process start; %s",
                 describe_startup(self.startup.elapsed(), self.startup.phases, "engine start"), since_process_start(),
                 compile_cache.describe())

    def _runner(self, cuda_graphs: bool, features: list[int] | None) -> ModelRunner:
        """Under a parallel layout the ranks run the steps this runner builds (distributed/executor.py).
        `features`: the target layers whose hidden states every step hands the drafter."""
        split = isinstance(self.model, RankWorkers)
        graphs = segments = None
        if cuda_graphs:
            # a decode step has at most one token per sequence, so the token budget caps it too
            max_batch = min(self.cfg.max_num_seqs, self.cfg.max_num_batched_tokens)
            # a step samples at most max_batch tokens: the next step reads them from the graphs' buffer
            sizes = graph_batch_sizes(max_batch)
            if split:
                graphs = RankGraphs(self.model, self.kv, self.max_model_len, sizes, max_batch)
            else:
                verify = verify_graph_sizes(self.cfg.speculative_config, max_batch, self.kv.block_size,
                                            dsa=self.model_config.index_topk is not None)
                graphs = DecodeGraphs(self.model, self.kv, self.max_model_len, sizes, max_batch, verify,
                                      self.kv.spec_width, features)
            graphs.capture()  # after the cache is allocated: graphs take what memory is left
            sizes = segment_graph_sizes(self.cfg.max_num_batched_tokens)
            if sizes and not split and not features and segment_graphs.supports(self.model):  # taps: no replay
                segments = segment_graphs.SegmentGraphs(self.model, sizes).capture()
            if self.spec is not None and not split:
                self.spec.capture_graphs(max_batch)
            self.startup.lap("graph capture")
        if split:
            return RankRunner(self.model, self.kv, graphs)
        return ModelRunner(self.model, self.kv, graphs, features, segments)

    # ---- requests --------------------------------------------------------------------------------
    def add_request(
        self, request_id: str, prompt: str | list[int] | dict, params: SamplingParams | None = None, *,
        arrival_time: float | None = None, priority: int = 0, cache_salt: str | None = None,
    ) -> None:
        """Queue a request. Raises ValueError (nothing queued) when the prompt or parameters are invalid."""
        params = params or SamplingParams()
        if request_id in self.parents:
            raise ValueError(f"request id '{request_id}' is already in use")
        text, ids = parse_prompt(prompt, self.tokenizer)
        params, max_tokens = self._checked(params, ids)
        arrival = arrival_time or time.time()
        children = []
        for i in range(params.n):
            child = Request(
                request_id=f"{request_id}" if params.n == 1 else f"{request_id}#{i}",
                prompt_token_ids=ids, params=params, max_tokens=max_tokens, arrival_time=arrival,
                priority=priority, cache_salt=cache_salt, prompt=text, parent_id=request_id, index=i,
            )
            if params.seed is not None:
                child.generator = torch.Generator(device=self.device).manual_seed(params.seed + i)
            if params.structured is not None:
                child.matcher = params.structured.new_matcher()
            child.output = CompletionState.for_request(child, self.tokenizer if self._detokenizes(params) else None)
            children.append(child)
        outputs = OutputAccumulator(request_id, text, ids, params, children[0].metrics)
        self.parents[request_id] = ParentRequest(request_id, outputs, children)
        for child in children:
            self.scheduler.add(child)

    def _checked(self, params: SamplingParams, ids: list[int]) -> tuple[SamplingParams, int]:
        """(params, max_tokens) for a prompt of `ids`; ValueError when they cannot be served."""
        vocab = self.model_config.vocab_size
        if not ids:
            raise ValueError("the prompt is empty")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {vocab}): {bad[:5]}")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(ids)} tokens, which leaves no room to generate within max_model_len "
                f"{self.max_model_len}"
            )
        room = self.max_model_len - len(ids)
        out_of_range = [t for t in params.logit_bias or () if not 0 <= t < vocab]
        if out_of_range:
            raise ValueError(f"logit_bias token ids out of range: {out_of_range[:5]}")
        # min_tokens masks the stop ids by index, so an id past the vocabulary would fail the engine step
        # (and with it every running request); it could never be sampled anyway.
        bad_stops = [t for t in params.stop_token_ids or () if not 0 <= t < vocab]
        if bad_stops:
            raise ValueError(f"stop_token_ids out of range [0, {vocab}): {bad_stops[:5]}")
        if params.stop and not self._detokenizes(params):
            raise ValueError("stop strings need detokenized text: this request (detokenize=False or an engine "
                             "without a tokenizer) has none; use stop_token_ids")
        if params.top_k >= vocab:
            # Keeping the whole vocabulary is "off"; a huge k (2**70) would not even fit the int64 tensor.
            params = dataclasses.replace(params, top_k=0)
        return params, room if params.max_tokens is None else min(params.max_tokens, room)

    def _detokenizes(self, params: SamplingParams) -> bool:
        return params.detokenize and self.tokenizer is not None

    def abort_request(self, request_id: str) -> None:
        parent = self.parents.get(request_id)
        if parent is None:
            return
        if self._in_flight is not None and any(c.num_pending for c in parent.children):
            self._drain()  # the prefix cache registers a request's blocks by their token ids when it ends
            self._stashed = [e for e in self._stashed if e[1].request_id != request_id]
        self.parents.pop(request_id, None)
        for child in parent.children:
            if not child.is_finished:
                self.scheduler.finish(child, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return bool(self.parents or self._stashed)

    # ---- the step --------------------------------------------------------------------------------
    @property
    def last_step(self) -> StepStats | None:
        """What the step whose results the last step() call read back computed; None when it read none."""
        return None if self._landed is None else StepStats.of(self._landed)

    def step(self) -> list[RequestOutput]:
        """One engine step; each touched request's output shaped by its output_kind (vLLM's meanings).
        Use this or `step_deltas`, not both: the shaping accumulates the deltas it sees."""
        return [o for parent, d in self._step() if (o := parent.outputs.add(d)) is not None]

    def step_deltas(self) -> list[RequestDelta]:
        """One engine step: what it added to each request it touched (new token ids, new text, new
        logprobs, the finish); text that might start a stop string is held back."""
        return [d for _, d in self._step()]

    def _step(self) -> list[_Emitted]:
        self._landed = None
        if self.cfg.async_scheduling:
            return self._step_async()
        out = self.scheduler.schedule()
        if not out.seqs:
            return self._unschedulable()
        return self._step_sync(out)

    def _step_sync(self, out: SchedulerOutput) -> list[_Emitted]:
        touched = {s.req for s in out.seqs}
        try:
            self._land(flight := self._launch(out, None))
            self._timed(flight)
            self.kv.cache_blocks(out)
        except Exception as e:  # a bug or bad state in one step must not take the engine down
            return self._fail_step(touched, e)
        self._landed = out
        return self._deltas(touched)

    def _spec_waits(self) -> bool:
        """Speculation needs the step before landed: its requests draft from their tokens on the host (unless
        the drafts could not pay for their step: the decoder's budget)."""
        if self.spec is None:
            return False
        running = self.scheduler.running
        return any(r.spec_token_ids for r in running) or (self.scheduler.speculating() and self.spec.may_draft(running))

    def _step_async(self) -> list[_Emitted]:
        """Launch step k+1 before reading back step k's tokens, so scheduling, input preparation and
        output processing on the host overlap the forward on the GPU (vLLM's async scheduling). Step
        k+1 reads step k's tokens on the device. A request that step k finishes has one more token
        computed in step k+1, which is dropped. Requests whose next sampling needs the previous token
        on the host (penalties, structured outputs) make that step wait for it. With speculation every step
        waits (n-gram drafts come from the host tokens) and a step with drafts lands before the next is
        planned: how many tokens it commits is known only after rejection sampling. Under load
        (disable_by_batch_size), once no request holds drafts, steps overlap again."""
        prev, self._in_flight = self._in_flight, None
        outputs, self._stashed = self._stashed, []
        if prev is not None and (self._spec_waits() or any(_needs_host_tokens(r) for r in prev.reqs)):
            outputs += self._finish(prev)
            prev = None
        out = self.scheduler.schedule()
        if not out.seqs:
            return outputs + (self._finish(prev) if prev is not None else self._unschedulable())
        if self.spec is not None and self.spec.verifies(out):
            return outputs + self._step_sync(out)
        touched = {s.req for s in out.seqs}
        try:
            launched = self._launch(out, prev)
        except Exception as e:
            if prev is not None:
                outputs += self._finish(prev)
            return outputs + self._fail_step(touched, e)
        if prev is not None:
            outputs += self._finish(prev)
        try:
            # queued behind this step's forward and before the next one's, with every computed id known
            self.kv.cache_blocks(out)
        except Exception as e:
            return outputs + self._fail_step(touched, e)
        self._in_flight = launched
        return outputs

    def _drain(self) -> None:
        """Read back the step in flight now; its outputs go out with the next step's."""
        flight, self._in_flight = self._in_flight, None
        if flight is not None:
            self._stashed += self._finish(flight)

    def _launch(self, out: SchedulerOutput, prev: _Launched | None) -> _Launched:
        """Run the forward and the sampler for `out` without reading anything back."""
        launched = time.perf_counter()
        self.kv.begin_step(out)  # queued cache copies land before the forward; its tokens count as computed
        pending = None
        if prev is not None and prev.result is not None:
            pending = PendingTokens(prev.result.token_ids, {r: j for j, r in enumerate(prev.reqs)})
        logits = self.runner.execute(out, pending) if self.spec is None else self.spec.execute(self.runner, out, pending)
        kind = "graph" if logits.graph else "eager"
        now = time.time()
        for s in out.seqs:
            if s.end >= s.req.num_prompt_tokens and not s.req.prompt_counted:
                # vLLM's prompt_tokens counts every prompt token once, cached or computed
                s.req.prompt_counted = True
                self.stats.prompt_tokens += s.req.num_prompt_tokens
                self.stats.prompt_tokens_cached += s.req.num_cached_tokens
                self.stats.prompt_tokens_external += s.req.num_external_cached_tokens
        self._prompt_logprobs(out, logits.prompt_logits)
        reqs = [out.seqs[i].req for i in logits.sample_rows]
        if self.spec is not None and self.spec.verifies(out):
            seqs = [out.seqs[i] for i in logits.sample_rows]
            with phase("sample"):
                result = self.spec.sample(seqs, logits.logits, self)
            flight = self._launched_verify(out, reqs, result, now, seqs)
            return dataclasses.replace(flight, kind=kind, launched=launched)
        result = self._sample_on_device(reqs, logits.logits) if reqs else None
        for r in reqs:
            r.num_pending += 1
        self.stats.last_step_tokens = out.num_tokens
        readback = None
        if result is not None:
            readback = Readback({"tokens": result.token_ids, "lps": result.logprobs, "ranks": result.ranks,
                                 "top_ids": result.top_token_ids, "top_lps": result.top_logprobs})
        return _Launched(out, reqs, result, now, readback, kind=kind, launched=launched)

    def _timed(self, flight: _Launched) -> None:
        self.stats.steps.landed(flight.kind, flight.out.num_tokens, flight.launched, time.perf_counter())

    def _launched_verify(self, out: SchedulerOutput, reqs: list[Request], result, now: float,
                         seqs: list[ScheduledSeq]) -> _Launched:
        for r in reqs:
            r.num_pending += 1
        self.stats.last_step_tokens = out.num_tokens
        return _Launched(out, reqs, result, now, verify=seqs)

    def _finish(self, flight: _Launched) -> list[_Emitted]:
        touched = {s.req for s in flight.out.seqs}
        try:
            self._land(flight)
            self._timed(flight)
        except Exception as e:
            return self._fail_step(touched, e)
        self._landed = flight.out
        return self._deltas(touched)

    def _fail_step(self, touched: set[Request], error: Exception) -> list[_Emitted]:
        """Fail the step's requests and free their resources; the other requests go on."""
        if isinstance(error, EngineDeadError):  # a rank of a parallel engine failed: the engine stops
            raise error
        log.exception("engine step failed; failing its %d requests", len(touched))
        for req in touched:
            if req.is_finished:
                continue
            req.error = f"internal error in the engine step: {type(error).__name__}: {error}"
            self.scheduler.finish(req, RequestStatus.FINISHED_ERROR)
        return self._deltas(touched)

    def _unschedulable(self) -> list[_Emitted]:
        """Nothing fits even with an empty running set: fail the head request instead of hanging."""
        if self.scheduler.running or not self.scheduler.waiting:
            return []
        req = self.scheduler._next_waiting()
        req.error = (
            f"the request needs {-(-req.num_tokens // self.kv.block_size)} cache pages but the pool holds "
            f"{self.kv.num_blocks}; raise the cache budget or shorten the prompt"
        )
        self.scheduler.finish(req, RequestStatus.FINISHED_ERROR)
        return self._deltas({req})

    def _prompt_logprobs(self, out: SchedulerOutput, prompt_logits: dict[int, torch.Tensor]) -> None:
        for i, lg in prompt_logits.items():
            s = out.seqs[i]
            req, k = s.req, s.req.params.prompt_logprobs
            if req.prompt_logprobs is None or s.start == 0:
                req.prompt_logprobs = [None]
            n = min(s.end, req.num_prompt_tokens - 1) - s.start  # positions that predict a prompt token
            if n <= 0:
                continue
            nxt = torch.tensor(req.prompt_token_ids[s.start + 1 : s.start + 1 + n], device=lg.device)
            r = compute_prompt_logprobs(lg[:n], nxt, k)
            rows = logprob_dicts(
                nxt.tolist(), r.token_logprobs.tolist(), r.ranks.tolist(),
                r.top_token_ids.tolist() if r.top_token_ids is not None else None,
                r.top_logprobs.tolist() if r.top_logprobs is not None else None, [k] * n,
            )
            req.prompt_logprobs.extend(self._decode_logprobs(rows))

    def _sample_on_device(self, reqs: list[Request], logits: torch.Tensor) -> SamplerOutput:
        # min_tokens counts outputs; a token still in flight is one (penalties never run with one)
        outputs = [r.output_token_ids + [-1] * r.num_pending if r.num_pending and r.params.min_tokens
                   else r.output_token_ids for r in reqs]
        meta = SamplingMetadata.build(
            [r.params for r in reqs], outputs, [r.prompt_token_ids for r in reqs],
            [r.generator for r in reqs], self.device, self.eos_token_ids, self.model_config.vocab_size,
        )
        constrained = [(j, r) for j, r in enumerate(reqs) if r.matcher is not None]
        return self.sampler(logits, meta, grammar_mask(constrained, logits))

    @phased("land")
    def _land(self, flight: _Launched) -> None:
        """Read the sampled tokens back and apply them: outputs, logprobs, detokenizing, stop checks."""
        res, reqs, now = flight.result, flight.reqs, flight.now
        if res is None:
            return
        if flight.verify is not None:
            return self.spec.land(flight.verify, res, now, self)
        for r in reqs:
            r.num_pending -= 1
        with phase("readback"):
            host = flight.readback.lists()
        tokens, lps, ranks, top_ids, top_lps = (host[k] for k in ("tokens", "lps", "ranks", "top_ids", "top_lps"))
        for j, req in enumerate(reqs):
            if req.is_finished:
                continue
            status = self.append_token(req, tokens[j], now, None if lps is None else lps[j],
                                       None if ranks is None else ranks[j], top_ids[j] if top_ids else None,
                                       top_lps[j] if top_lps else None)
            if status is not None:
                req.metrics.finished_time = time.time()
                self.scheduler.finish(req, status)
        if self.spec is not None:
            self.spec.propose(reqs)

    def append_token(self, req: Request, tok: int, now: float, lp: float | None, rank: int | None,
                     top_ids: list[int] | None, top_lps: list[float] | None) -> RequestStatus | None:
        """One sampled token onto req (outputs, logprobs, grammar, text); the status it finishes with, or None
        (the caller finishes it: a verify step first moves the request's computed count)."""
        req.output_token_ids.append(tok)
        if lp is not None:  # None when no request of the step asked for logprobs
            req.cumulative_logprob += lp
        self.stats.generation_tokens += 1
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = now
        req.metrics.last_token_time = now
        if req.output.new_logprobs is not None:
            row = logprob_dicts([tok], [lp], [rank], None if top_ids is None else [top_ids],
                                None if top_lps is None else [top_lps], [req.params.logprobs])
            req.output.new_logprobs.extend(self._decode_logprobs(row))
        if req.matcher is not None:
            req.matcher.accept(tok)
        if req.output.detok is not None:
            req.output.text += req.output.detok.step(tok)
        return check_stop(req, tok, self.eos_token_ids, self.max_model_len)

    def _decode_logprobs(self, rows: list[dict[int, Logprob]]) -> list[dict[int, Logprob]]:
        if self.tokenizer is None:
            return rows  # no tokenizer: decoded_token stays None, as in vLLM
        for row in rows:
            for tid, lp in row.items():
                lp.decoded_token = self.tokenizer.decode([tid], skip_special_tokens=False)
        return rows

    # ---- outputs ---------------------------------------------------------------------------------
    def _delta_of(self, parent: ParentRequest) -> RequestDelta | None:
        """The parent's delta; a failure to build it (one request's data) fails that request alone."""
        try:
            return parent.delta()
        except Exception as e:
            log.exception("reporting request %r failed", parent.request_id)
            for child in parent.children:
                if not child.is_finished:
                    self.scheduler.finish(child, RequestStatus.FINISHED_ERROR)
            return RequestDelta(parent.request_id, finished=True, error=f"the engine failed on this request: {e!r}")

    @phased("outputs")
    def _deltas(self, touched: set[Request]) -> list[_Emitted]:
        """Each touched request's delta; a finished request leaves the engine with it."""
        seen, outs = set(), []
        for req in touched:
            rid = req.parent_id
            parent = self.parents.get(rid)
            if parent is None or rid in seen:
                continue
            seen.add(rid)
            d = self._delta_of(parent)
            if d is not None:
                outs.append((parent, d))
                if d.finished:
                    del self.parents[rid]
        self.stats.num_running = len(self.scheduler.running)
        self.stats.num_waiting = len(self.scheduler.waiting)
        self.stats.kv_cache_usage = self.kv.usage
        self.stats.num_preemptions = self.scheduler.num_preemptions
        self.stats.prefix_cache_queries, self.stats.prefix_cache_hits = self.kv.prefix_stats
        self.stats.kernels_compiled_after_ready = compile_watch.watch().after_ready - self._compiled_at_ready
        return outs
