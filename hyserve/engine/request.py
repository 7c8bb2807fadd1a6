"""A request inside the engine: its tokens, progress, cache resources and sampling state."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from hyserve.outputs import Logprob, RequestMetrics
from hyserve.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self.value in ("stop", "length", "abort", "error")


@dataclass(eq=False)  # identity semantics: requests live in sets and queues
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int
    arrival_time: float = field(default_factory=time.time)
    priority: int = 0
    cache_salt: str | None = None
    prompt: str | None = None
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    # tokens sampled on the device but not yet read back (async scheduling: at most one per launched step)
    num_pending: int = 0
    # written by the cache manager (kv_cache.KVCacheManager) alone
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    state_slot: int | None = None
    fresh_state: bool = True  # the next forward starts from a zero KDA state
    num_cached_tokens: int = 0  # prompt tokens the prefix hit skipped
    num_external_cached_tokens: int = 0  # of those, restored from the CPU tier
    generator: torch.Generator | None = None
    cumulative_logprob: float = 0.0
    logprobs: list[dict[int, Logprob]] | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    error: str | None = None
    metrics: RequestMetrics = None  # type: ignore[assignment]
    # per-request engine extras (prefix-cache bookkeeping, detokenizer, ...)
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.metrics is None:
            self.metrics = RequestMetrics(arrival_time=self.arrival_time)
        if self.params.logprobs is not None:
            self.logprobs = []

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Tokens of the sequence, pending ones included: what the scheduler plans with."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending

    @property
    def num_known_tokens(self) -> int:
        """Tokens whose ids the host has: what stop checks and the prefix cache's hashes use."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """The known token ids (pending ones are still on the device)."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status.finished
