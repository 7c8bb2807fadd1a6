"""Per-request sampling settings, with vLLM's field names and meanings (docs/ARCHITECTURE.md §8.3)."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Any

from hyserve import envs


class RequestOutputKind(enum.IntEnum):
    """Which outputs the engine emits for a request (vLLM's names)."""

    CUMULATIVE = 0  # after every step, everything generated so far
    DELTA = 1  # after every step, what that step added
    FINAL_ONLY = 2  # once, when the request finishes


# Below this temperature a request is greedy: dividing logits by ~0 would overflow, and the
# distribution is a point mass on the argmax anyway.
SAMPLING_EPS = 1e-5
# The OpenAI API caps top_logprobs at 20; a larger k would also make every step's top-k costly.
MAX_LOGPROBS = 20


def max_n() -> int:
    """The largest n (vLLM's VLLM_MAX_N_SEQUENCES, default 16384): every completion is a sequence the
    engine builds up front, so an unbounded n (10**9) would exhaust the engine's memory instead of failing
    the one request. HYSERVE_MAX_N_SEQUENCES (envs.py) lowers it; /openapi.json shows it."""
    return envs.get().max_n_sequences


# Seeds are int64, as in vLLM's API; the engine seeds completion i with seed + i.
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
# OpenAI's documented logit_bias range (vLLM clamps to it too): a larger bias already forces or bans
# the token, and an overflowing one (1e308) would turn the logits into NaN.
MAX_LOGIT_BIAS = 100.0


class SamplingType(enum.IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


@dataclass
class SamplingParams:
    """How to pick the tokens of one request.

    After construction `stop` and `stop_token_ids` are always lists, `top_k` -1 is stored as 0 and
    `logit_bias` keys are ints. `max_tokens=None` means "up to the context limit" (the engine resolves
    it against max_model_len).
    `structured` carries a structured-output constraint (a grammar matcher factory); the sampler only
    ever sees its per-step allowed-token mask.
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    structured: Any = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        self._normalise()
        self._validate()
        if self.is_greedy:
            # Truncation cannot change an argmax; turning it off lets the sampler skip that work.
            self.top_p = 1.0
            self.top_k = 0
            self.min_p = 0.0

    def _normalise(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = [] if self.stop_token_ids is None else [int(t) for t in self.stop_token_ids]
        if self.top_k == -1:
            self.top_k = 0
        if self.logit_bias is not None:
            # JSON object keys arrive as strings.
            try:
                self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except (TypeError, ValueError) as e:
                raise ValueError(f"logit_bias keys must be token ids, got {self.logit_bias!r}") from e
            if not all(math.isfinite(v) for v in self.logit_bias.values()):
                raise ValueError(f"logit_bias values must be finite numbers, got {self.logit_bias}")
            self.logit_bias = {k: min(MAX_LOGIT_BIAS, max(-MAX_LOGIT_BIAS, v)) for k, v in self.logit_bias.items()}

    def _validate(self) -> None:
        if not 1 <= self.n <= max_n():
            raise ValueError(f"n must be in [1, {max_n()}], got {self.n}")
        # NaN passes every comparison below and inf slips past the one-sided ones; either turns the
        # logits into NaN, and the request would silently return token 0 over and over.
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number, got {getattr(self, name)}")
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            raise ValueError(f"seed must be in [{SEED_MIN}, {SEED_MAX}], got {self.seed}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if self.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty must be greater than zero, got {self.repetition_penalty}")
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be 0 or -1 (off) or at least 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be non-negative, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, "
                f"got {self.min_tokens}"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}")
        if any(s == "" for s in self.stop):
            raise ValueError("stop cannot contain an empty string")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative, got {self.stop_token_ids}")
        if self.logit_bias is not None and any(k < 0 for k in self.logit_bias):
            raise ValueError(f"logit_bias keys must be non-negative token ids, got {self.logit_bias}")

    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < SAMPLING_EPS:
            return SamplingType.GREEDY
        if self.seed is not None:
            return SamplingType.RANDOM_SEED
        return SamplingType.RANDOM

    @property
    def is_greedy(self) -> bool:
        return self.sampling_type == SamplingType.GREEDY

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
