"""add_request / abort / step: the engine loop (DESIGN.md §3)."""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from dataclasses import dataclass, field

import torch

from hyserve.config import EngineConfig
from hyserve.engine.cuda_graphs import DecodeGraphs, graph_batch_sizes
from hyserve.engine.kv_cache import KVCacheManager, plan_cache
from hyserve.engine.model_runner import ModelRunner, PendingTokens
from hyserve.engine.readback import Readback
from hyserve.engine.request import Request, RequestStatus
from hyserve.engine.sampler import (
    Sampler,
    SamplerOutput,
    SamplingMetadata,
    compute_prompt_logprobs,
    logprob_dicts,
)
from hyserve.engine.scheduler import Scheduler, SchedulerOutput
from hyserve.models.loader import load_model, resolve_dtype
from hyserve.outputs import CompletionOutput, Logprob, RequestOutput
from hyserve.sampling_params import RequestOutputKind, SamplingParams
from hyserve.tokenizer import IncrementalDetokenizer, Tokenizer, load_tokenizer

log = logging.getLogger(__name__)


@dataclass
class _Parent:
    """A user request; n > 1 fans out into n child requests that are scheduled independently."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[Request] = field(default_factory=list)


@dataclass
class _Launched:
    """A step whose forward and sampling are queued on the device; its tokens are not read back yet."""

    out: SchedulerOutput
    reqs: list[Request]  # the requests that sample, in the sampler's row order
    result: SamplerOutput | None  # None when no sequence samples (prefill chunks only)
    now: float
    readback: Readback | None = None  # the result's host copies, queued behind the sampler


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


class LLMEngine:
    def __init__(
        self, cfg: EngineConfig, model=None, tokenizer: Tokenizer | None = None, *, cuda_graphs: bool | None = None,
        skip_tokenizer_init: bool = False,
    ):
        """`cuda_graphs`: None = capture decode graphs on CUDA unless cfg.enforce_eager (vLLM's default;
        HYSERVE_CUDA_GRAPHS=0 turns them off too). True on the CPU runs decode steps through the same
        static, padded buffers without a graph: for tests of that path. `skip_tokenizer_init` (vLLM's):
        load no tokenizer; prompts are token ids and outputs carry token ids, with empty text."""
        self.cfg = cfg
        device = cfg.device or ("cuda" if torch.cuda.is_available() else "cpu")
        torch.manual_seed(cfg.seed)
        self.model = model if model is not None else load_model(cfg.model, dtype=cfg.dtype, device=device, seed=cfg.seed)
        self.model_config = self.model.config
        self.device = self.model.device
        if cfg.async_scheduling is None:
            cfg.async_scheduling = self.device.type == "cuda"
        self.tokenizer = tokenizer
        if tokenizer is None and not skip_tokenizer_init:
            path = cfg.tokenizer or (cfg.model if os.path.isdir(cfg.model) else None)
            self.tokenizer = load_tokenizer(path, self.model_config.tokenizer_family)
        limit = self.model_config.max_position_embeddings
        self.max_model_len = min(cfg.max_model_len or limit, limit)
        cache_dtype = self.model.dtype if cfg.kv_cache_dtype == "auto" else resolve_dtype(cfg.kv_cache_dtype, self.model_config)
        if cuda_graphs is None:
            allowed = os.environ.get("HYSERVE_CUDA_GRAPHS", "1") != "0"
            cuda_graphs = self.device.type == "cuda" and not cfg.enforce_eager and allowed
        self.cache_plan = plan_cache(cfg, self.model, cache_dtype, self.max_model_len, scratch=cuda_graphs)
        log.info(self.cache_plan.describe())
        self.kv = KVCacheManager(self.model, self.cache_plan, cache_dtype)
        self.prefix_cache = self._make_prefix_cache()
        self.scheduler = Scheduler(cfg, self.kv, self.prefix_cache)
        graphs = None
        if cuda_graphs:
            # a decode step has at most one token per sequence, so the token budget caps it too
            max_batch = min(cfg.max_num_seqs, cfg.max_num_batched_tokens)
            # a step samples at most max_batch tokens: the next step reads them from the graphs' buffer
            graphs = DecodeGraphs(self.model, self.kv, self.max_model_len, graph_batch_sizes(max_batch), max_batch)
            graphs.capture()  # after the cache is allocated: graphs take what memory is left
        self.runner = ModelRunner(self.model, self.kv, graphs)
        self.sampler = Sampler()
        tokenizer_eos = [self.tokenizer.eos_token_id] if self.tokenizer is not None else []
        self.eos_token_ids = list(self.model_config.eos_token_ids) or tokenizer_eos
        self.parents: dict[str, _Parent] = {}
        self.requests: dict[str, Request] = {}
        self.stats = EngineStats()
        self._in_flight: _Launched | None = None  # async scheduling: the step whose tokens are on the device
        self._stashed: list[RequestOutput] = []  # outputs of a step read back early (an abort)

    def _make_prefix_cache(self):
        if not self.cfg.enable_prefix_caching:
            return None
        try:
            from hyserve.engine.prefix_cache import PrefixCache
        except ImportError:  # built without the prefix cache module
            return None
        return PrefixCache(self.cfg, self.kv, self.model_config)

    # ---- requests --------------------------------------------------------------------------------
    def add_request(
        self, request_id: str, prompt: str | list[int] | dict, params: SamplingParams | None = None, *,
        arrival_time: float | None = None, priority: int = 0, cache_salt: str | None = None,
    ) -> None:
        """Queue a request. Raises ValueError (nothing queued) when the prompt or parameters are invalid."""
        params = params or SamplingParams()
        if request_id in self.parents:
            raise ValueError(f"request id '{request_id}' is already in use")
        text, ids = self._prompt_ids(prompt)
        if not ids:
            raise ValueError("the prompt is empty")
        bad = [t for t in ids if not 0 <= t < self.model_config.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {self.model_config.vocab_size}): {bad[:5]}")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(ids)} tokens, which leaves no room to generate within max_model_len "
                f"{self.max_model_len}"
            )
        room = self.max_model_len - len(ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        if params.logit_bias:
            out_of_range = [t for t in params.logit_bias if not 0 <= t < self.model_config.vocab_size]
            if out_of_range:
                raise ValueError(f"logit_bias token ids out of range: {out_of_range[:5]}")
        vocab = self.model_config.vocab_size
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
        arrival = arrival_time or time.time()
        parent = _Parent(request_id, text, ids)
        for i in range(params.n):
            child = Request(
                request_id=f"{request_id}" if params.n == 1 else f"{request_id}#{i}",
                prompt_token_ids=ids, params=params, max_tokens=max_tokens, arrival_time=arrival,
                priority=priority, cache_salt=cache_salt, prompt=text,
            )
            if params.seed is not None:
                child.generator = torch.Generator(device=self.device).manual_seed(params.seed + i)
            child.extra["index"] = i
            child.extra["parent"] = request_id
            child.extra["detok"] = (IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens)
                                    if self._detokenizes(params) else None)
            child.extra["text"] = ""
            parent.children.append(child)
            self.scheduler.add(child)
        self.parents[request_id] = parent

    def _prompt_ids(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer, and this engine has none (skip_tokenizer_init=True): "
                                 "pass token ids, e.g. {'prompt_token_ids': [...]}")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise ValueError(f"unsupported prompt type {type(prompt).__name__}")

    def _detokenizes(self, params: SamplingParams) -> bool:
        return params.detokenize and self.tokenizer is not None

    def abort_request(self, request_id: str) -> None:
        parent = self.parents.get(request_id)
        if parent is None:
            return
        if self._in_flight is not None and any(c.num_pending for c in parent.children):
            self._drain()  # the prefix cache registers a request's blocks by their token ids when it ends
            self._stashed = [o for o in self._stashed if o.request_id != request_id]
        self.parents.pop(request_id, None)
        for child in parent.children:
            if not child.is_finished:
                self.scheduler.finish(child, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return bool(self.parents or self._stashed)

    # ---- the step --------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        if self.cfg.async_scheduling:
            return self._step_async()
        out = self.scheduler.schedule()
        if not out.seqs:
            return self._unschedulable()
        touched = {s.req for s in out.seqs}
        try:
            self._land(self._launch(out, None))
            if self.prefix_cache is not None:
                self.prefix_cache.after_step(out)
        except Exception as e:  # a bug or bad state in one step must not take the engine down
            return self._fail_step(touched, e)
        return self._outputs(touched)

    def _step_async(self) -> list[RequestOutput]:
        """Launch step k+1 before reading back step k's tokens, so scheduling, input preparation and
        output processing on the host overlap the forward on the GPU (vLLM's async scheduling). Step
        k+1 reads step k's tokens on the device. A request that step k finishes has one more token
        computed in step k+1, which is dropped. Requests whose next sampling needs the previous token
        on the host (penalties, structured outputs) make that step wait for it."""
        prev, self._in_flight = self._in_flight, None
        outputs, self._stashed = self._stashed, []
        if prev is not None and any(_needs_host_tokens(r) for r in prev.reqs):
            outputs += self._finish(prev)
            prev = None
        out = self.scheduler.schedule()
        if not out.seqs:
            return outputs + (self._finish(prev) if prev is not None else self._unschedulable())
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
            if self.prefix_cache is not None:
                self.prefix_cache.after_step(out)
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
        if self.prefix_cache is not None:
            self.prefix_cache.before_step(out)  # queued cache copies land before the forward reads them
        pending = None
        if prev is not None and prev.result is not None:
            pending = PendingTokens(prev.result.token_ids, {r: j for j, r in enumerate(prev.reqs)})
        logits = self.runner.execute(out, pending)
        now = time.time()
        for s in out.seqs:
            s.req.num_computed_tokens = s.end
            s.req.fresh_state = False
            if s.end >= s.req.num_prompt_tokens and not s.req.extra.get("prompt_counted"):
                # vLLM's prompt_tokens counts every prompt token once, cached or computed
                s.req.extra["prompt_counted"] = True
                self.stats.prompt_tokens += s.req.num_prompt_tokens
                self.stats.prompt_tokens_cached += s.req.num_cached_tokens
                self.stats.prompt_tokens_external += s.req.extra.get("external_cached_tokens", 0)
        self._prompt_logprobs(out, logits.prompt_logits)
        reqs = [out.seqs[i].req for i in logits.sample_rows]
        result = self._sample_on_device(reqs, logits.logits) if reqs else None
        for r in reqs:
            r.num_pending += 1
        self.stats.last_step_tokens = out.num_tokens
        readback = None
        if result is not None:
            readback = Readback({"tokens": result.token_ids, "lps": result.logprobs, "ranks": result.ranks,
                                 "top_ids": result.top_token_ids, "top_lps": result.top_logprobs})
        return _Launched(out, reqs, result, now, readback)

    def _finish(self, flight: _Launched) -> list[RequestOutput]:
        touched = {s.req for s in flight.out.seqs}
        try:
            self._land(flight)
        except Exception as e:
            return self._fail_step(touched, e)
        return self._outputs(touched)

    def _fail_step(self, touched: set[Request], error: Exception) -> list[RequestOutput]:
        """Fail the step's requests and free their resources; the other requests go on."""
        log.exception("engine step failed; failing its %d requests", len(touched))
        for req in touched:
            if req.is_finished:
                continue
            req.error = f"internal error in the engine step: {type(error).__name__}: {error}"
            req.fresh_state = True  # its cache contents are suspect: never snapshot or register them
            self.scheduler.finish(req, RequestStatus.FINISHED_ERROR)
        return self._outputs(touched)

    def _unschedulable(self) -> list[RequestOutput]:
        """Nothing fits even with an empty running set: fail the head request instead of hanging."""
        if self.scheduler.running or not self.scheduler.waiting:
            return []
        req = self.scheduler._next_waiting()
        req.error = (
            f"the request needs {-(-req.num_tokens // self.kv.block_size)} cache pages but the pool holds "
            f"{self.kv.blocks.num_blocks}; raise the cache budget or shorten the prompt"
        )
        self.scheduler.finish(req, RequestStatus.FINISHED_ERROR)
        return self._outputs({req})

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
        return self.sampler(logits, meta, self._allowed_mask(reqs, logits))

    def _land(self, flight: _Launched) -> None:
        """Read the sampled tokens back and apply them: outputs, logprobs, detokenizing, stop checks."""
        res, reqs, now = flight.result, flight.reqs, flight.now
        if res is None:
            return
        for r in reqs:
            r.num_pending -= 1
        host = flight.readback.lists()
        tokens, lps, ranks, top_ids, top_lps = (host[k] for k in ("tokens", "lps", "ranks", "top_ids", "top_lps"))
        for j, req in enumerate(reqs):
            if req.is_finished:
                continue
            tok = tokens[j]
            req.output_token_ids.append(tok)
            if lps is not None:  # None when no request of the step asked for logprobs
                req.cumulative_logprob += lps[j]
            self.stats.generation_tokens += 1
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = now
            req.metrics.last_token_time = now
            if req.logprobs is not None:
                k = req.params.logprobs
                row = logprob_dicts([tok], [lps[j]], [ranks[j]], [top_ids[j]] if top_ids else None,
                                    [top_lps[j]] if top_lps else None, [k])
                req.logprobs.extend(self._decode_logprobs(row))
            structured = req.extra.get("matcher")
            if structured is not None:
                structured.accept(tok)
            if req.extra["detok"] is not None:
                req.extra["text"] += req.extra["detok"].step(tok)
            self._check_stop(req, tok)

    def _allowed_mask(self, reqs: list[Request], logits: torch.Tensor) -> torch.Tensor | None:
        """Structured outputs: rows whose request carries a grammar matcher get its allowed-token mask."""
        rows = [(j, r) for j, r in enumerate(reqs) if r.params.structured is not None]
        if not rows:
            return None
        mask = torch.ones_like(logits, dtype=torch.bool)
        for j, r in rows:
            if "matcher" not in r.extra:
                r.extra["matcher"] = r.params.structured.new_matcher()
            mask[j] = r.extra["matcher"].allowed_mask(logits.shape[1]).to(mask.device)
        return mask

    def _decode_logprobs(self, rows: list[dict[int, Logprob]]) -> list[dict[int, Logprob]]:
        if self.tokenizer is None:
            return rows  # no tokenizer: decoded_token stays None, as in vLLM
        for row in rows:
            for tid, lp in row.items():
                lp.decoded_token = self.tokenizer.decode([tid], skip_special_tokens=False)
        return rows

    def _check_stop(self, req: Request, tok: int) -> None:
        p = req.params
        status = None
        if not p.ignore_eos and tok in self.eos_token_ids and len(req.output_token_ids) >= p.min_tokens:
            status = RequestStatus.FINISHED_STOPPED
        elif tok in (p.stop_token_ids or ()) and len(req.output_token_ids) >= p.min_tokens:
            status, req.stop_reason = RequestStatus.FINISHED_STOPPED, tok
        elif p.stop and len(req.output_token_ids) >= p.min_tokens and self._stop_string(req):
            status = RequestStatus.FINISHED_STOPPED
        elif len(req.output_token_ids) >= req.max_tokens or req.num_known_tokens >= self.max_model_len:
            status = RequestStatus.FINISHED_LENGTH
        if status is not None:
            if not isinstance(req.stop_reason, str) and req.extra["detok"] is not None:
                req.extra["text"] += req.extra["detok"].finish()  # (a stop string already cut the text)
            req.metrics.finished_time = time.time()
            self.scheduler.finish(req, status)

    def _stop_string(self, req: Request) -> bool:
        text = req.extra["text"]
        window = max(len(s) for s in req.params.stop) + 8
        # a stop string can only end inside the newest text: search a bounded tail, not the whole output
        tail_start = max(0, len(text) - window - 64)
        best = None
        for s in req.params.stop:
            i = text.find(s, tail_start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return False
        i, s = best
        req.extra["text"] = text[: i + len(s)] if req.params.include_stop_str_in_output else text[:i]
        req.stop_reason = s
        return True

    # ---- outputs ---------------------------------------------------------------------------------
    def _outputs(self, touched: set[Request]) -> list[RequestOutput]:
        seen, outs = set(), []
        for req in touched:
            rid = req.extra["parent"]
            if rid in seen or rid not in self.parents:
                continue
            seen.add(rid)
            parent = self.parents[rid]
            finished = all(c.is_finished for c in parent.children)
            if not finished and req.params.output_kind == RequestOutputKind.FINAL_ONLY:
                continue
            outs.append(self.make_output(parent))
            if finished:
                del self.parents[rid]
        self.stats.num_running = len(self.scheduler.running)
        self.stats.num_waiting = len(self.scheduler.waiting)
        self.stats.kv_cache_usage = self.kv.usage
        self.stats.num_preemptions = self.scheduler.num_preemptions
        if self.prefix_cache is not None:
            self.stats.prefix_cache_queries = self.prefix_cache.queries
            self.stats.prefix_cache_hits = self.prefix_cache.hits
        return outs

    def make_output(self, parent: _Parent) -> RequestOutput:
        comps = []
        for c in parent.children:
            fin = c.status.value if c.is_finished else None
            comps.append(CompletionOutput(
                index=c.extra["index"], text=c.extra["text"], token_ids=list(c.output_token_ids),
                cumulative_logprob=c.cumulative_logprob if c.params.logprobs is not None else None,
                logprobs=c.logprobs, finish_reason=fin, stop_reason=c.stop_reason,
            ))
        first = parent.children[0]
        out = RequestOutput(
            request_id=parent.request_id, prompt=parent.prompt, prompt_token_ids=parent.prompt_token_ids,
            prompt_logprobs=first.prompt_logprobs, outputs=comps,
            finished=all(c.is_finished for c in parent.children), metrics=first.metrics,
            num_cached_tokens=first.num_cached_tokens,
        )
        out.error = next((c.error for c in parent.children if c.error), None)
        return out
