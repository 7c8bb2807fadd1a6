"""A request inside the engine: its tokens, progress, cache resources and sampling state.

Each field group has one writer: the cache manager (block table, computed tokens, state slot), the
engine loop (outputs, pending tokens, stats), the output side (`output`, engine/output_processor.py).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from hyserve.outputs import Logprob, RequestMetrics
from hyserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from hyserve.engine.output_processor import CompletionState
    from hyserve.structured.constraint import StructuredMatcher


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
        return self._value_ in _FINISHED  # not .value: a descriptor call, on the per-token path


_FINISHED = frozenset({"stop", "length", "abort", "error"})


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
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    error: str | None = None
    metrics: RequestMetrics = None  # type: ignore[assignment]
    parent_id: str = ""  # the user's request id (n > 1 fans one out into n of these)
    index: int = 0  # which of the parent's n completions
    output: CompletionState | None = None  # text, stop holdback and what was sent
    matcher: StructuredMatcher | None = None  # structured outputs: the grammar state
    prompt_counted: bool = False  # its prompt is in EngineStats.prompt_tokens
    # speculative decoding: the drafts its next step verifies (the engine's proposer writes them) and its
    # row of 1+K state slots (the cache manager's; state_slot is the column holding the current state)
    spec_token_ids: list[int] = field(default_factory=list)
    spec_slots: list[int] | None = None

    def __post_init__(self) -> None:
        if self.metrics is None:
            self.metrics = RequestMetrics(arrival_time=self.arrival_time)

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
