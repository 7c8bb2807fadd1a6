"""What the engine hands back per request: the per-step deltas it emits, and vLLM-shaped `RequestOutput`s
built from them (`OutputAccumulator`) so callers can switch."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from hyserve.sampling_params import RequestOutputKind, SamplingParams


@dataclass
class Logprob:
    """One token's log-probability under the model's raw distribution; `rank` is 1-based."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One entry per position: token id -> Logprob. Prompt logprobs start with None (no context for token 0).
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    """One of a request's `n` completions. `text` and `token_ids` are cumulative, or deltas when streamed.

    `finish_reason` is "stop", "length" or "abort" (None while running); `stop_reason` is the matched stop
    string or stop token id, None for EOS or when not stopped.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None

    def __repr__(self) -> str:
        return (
            f"CompletionOutput(index={self.index}, text={self.text!r}, token_ids={self.token_ids}, "
            f"cumulative_logprob={self.cumulative_logprob}, logprobs={self.logprobs}, "
            f"finish_reason={self.finish_reason}, stop_reason={self.stop_reason})"
        )


@dataclass
class RequestMetrics:
    """Wall-clock timestamps (time.time()) of a request's life; None until the event happens."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None

    @property
    def time_in_queue(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    """The state of one request after an engine step: its prompt and its `n` completions."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    # Prompt tokens served from the prefix cache (local or offloaded) rather than recomputed.
    num_cached_tokens: int = 0
    # Set when the request failed (a bad prompt or parameter, or a prompt the cache can never hold).
    error: str | None = None

    def __repr__(self) -> str:
        return (
            f"RequestOutput(request_id={self.request_id}, prompt={self.prompt!r}, "
            f"prompt_token_ids={self.prompt_token_ids}, prompt_logprobs={self.prompt_logprobs}, "
            f"outputs={self.outputs}, finished={self.finished}, metrics={self.metrics}, "
            f"num_cached_tokens={self.num_cached_tokens})"
        )


@dataclass
class CompletionDelta:
    """What one engine step added to a completion."""

    index: int
    token_ids: list[int]
    text: str
    logprobs: SampleLogprobs | None = None  # the new positions only
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    cumulative_logprob: float | None = None  # after these tokens; None unless logprobs were asked for


@dataclass
class RequestDelta:
    """What one engine step added to a request: the engine's output (and its engine-process message)."""

    request_id: str
    completions: list[CompletionDelta] = field(default_factory=list)
    finished: bool = False
    accepted: bool = False  # the engine took the request (sent once, before any tokens)
    error: str | None = None
    bad_request: bool = False  # the error is the client's fault (HTTP 400), not the engine's
    num_cached_tokens: int = 0
    # Sent once, whole, with the first delta after prefill (one entry per prompt token, the first None)
    prompt_logprobs: PromptLogprobs | None = None
    metrics: RequestMetrics | None = None  # on the finishing delta


class OutputAccumulator:
    """A request's `RequestOutput`s built from its deltas, as `output_kind` asks (vLLM's meanings): DELTA
    hands on each step's news, CUMULATIVE everything so far after every step, FINAL_ONLY everything once
    the request has finished."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int] | None,
                 params: SamplingParams, metrics: RequestMetrics | None = None):
        self.request_id, self.prompt, self.prompt_token_ids = request_id, prompt, prompt_token_ids
        self.kind, self.metrics = params.output_kind, metrics
        lps = [] if params.logprobs is not None else None
        self.completions = [CompletionOutput(i, "", [], None, None if lps is None else []) for i in range(params.n)]
        self.prompt_logprobs: PromptLogprobs | None = None
        self.num_cached_tokens = 0

    def add(self, d: RequestDelta) -> RequestOutput | None:
        """Take one delta; the output it makes, if any."""
        if self.kind == RequestOutputKind.DELTA:
            self._meta(d)
            return self._output(d, [CompletionOutput(c.index, c.text, c.token_ids, c.cumulative_logprob, c.logprobs,
                                                     c.finish_reason, c.stop_reason) for c in d.completions])
        self.accumulate(d)
        if self.kind == RequestOutputKind.FINAL_ONLY and not d.finished:
            return None
        return self.output(d)

    def accumulate(self, d: RequestDelta) -> None:
        self._meta(d)
        for c in d.completions:
            acc = self.completions[c.index]
            acc.text += c.text
            acc.token_ids.extend(c.token_ids)
            if c.logprobs:
                acc.logprobs.extend(c.logprobs)
            acc.cumulative_logprob = c.cumulative_logprob
            acc.finish_reason, acc.stop_reason = c.finish_reason, c.stop_reason

    def output(self, d: RequestDelta) -> RequestOutput:
        """Everything accumulated so far (a snapshot: later deltas do not change it)."""
        return self._output(d, [dataclasses.replace(c, token_ids=list(c.token_ids),
                                                    logprobs=None if c.logprobs is None else list(c.logprobs))
                                for c in self.completions])

    def _meta(self, d: RequestDelta) -> None:
        self.metrics = d.metrics or self.metrics
        self.prompt_logprobs = d.prompt_logprobs if d.prompt_logprobs is not None else self.prompt_logprobs
        self.num_cached_tokens = d.num_cached_tokens

    def _output(self, d: RequestDelta, comps: list[CompletionOutput]) -> RequestOutput:
        out = RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, self.prompt_logprobs, comps,
                            d.finished, self.metrics, self.num_cached_tokens)
        out.error = d.error
        return out
