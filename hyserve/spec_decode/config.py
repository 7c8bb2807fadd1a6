"""`--speculative-config`: one flat dataclass with vLLM's keys, parsed from a JSON object.

vLLM's names and defaults where it has the setting (method, num_speculative_tokens, model,
prompt_lookup_min/max, draft_sample_method, rejection_sample_method, synthetic_acceptance_rates /
synthetic_acceptance_length, disable_by_batch_size). `confidence_threshold` is hyserve's own: confidence-scheduled
verification, from a DSpark drafter's confidence head, or for n-gram drafts from each request's measured
acceptance (on by default there). Both methods run a draft budget by default (draft_budget.py: drafts are
verified only when they pay for their step, a DSpark drafter's forward included, so a drafter that does not
pay turns itself down); `confidence_threshold` 0 turns the budget off and verifies every draft, as vLLM does
(docs/speculative_decoding.md, "Draft budget").
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from typing import Any

METHODS = ("ngram", "dspark")
DRAFT_SAMPLE_METHODS = ("greedy", "probabilistic")
REJECTION_SAMPLE_METHODS = ("standard", "synthetic")
# vLLM's MAX_SPEC_LEN: the rejection sampler's per-request draft limit
MAX_SPEC_TOKENS = 128
# vLLM's n-gram default when neither lookup bound is given
DEFAULT_PROMPT_LOOKUP = 5
# n-gram drafts: the survival (measured acceptance ^ position) a draft needs to be verified, unless given
DEFAULT_NGRAM_CONFIDENCE = 0.3


@dataclass
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int | None = None  # dspark: None = the drafter's block size
    model: str | None = None  # dspark: the drafter checkpoint directory
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    draft_sample_method: str = "greedy"
    rejection_sample_method: str = "standard"
    # synthetic: entry i is the probability that drafts 0..i are all accepted (non-increasing)
    synthetic_acceptance_rates: list[float] | None = None
    synthetic_acceptance_length: float | None = None  # mean accepted per step incl. the bonus, in [1, k+1]
    # verify the draft prefix whose predicted survival clears it (n-gram: None = DEFAULT_NGRAM_CONFIDENCE;
    # dspark: None = no cut, every block whole). Either way drafts must pay for their step (the draft budget);
    # 0 verifies every draft, without a budget
    confidence_threshold: float | None = None
    # under load speculation turns itself off: a step whose running batch holds at least this many requests
    # verifies no drafts (a full batch is bound by the weights' reads, which drafts do not share out)
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {', '.join(METHODS)}, got {self.method!r}")
        self._check_counts()
        if self.method == "ngram":
            self._resolve_lookup()
        elif self.model is None:
            raise ValueError("method 'dspark' needs 'model' (the drafter checkpoint directory)")
        if self.draft_sample_method not in DRAFT_SAMPLE_METHODS:
            raise ValueError(f"draft_sample_method must be one of {', '.join(DRAFT_SAMPLE_METHODS)}, "
                             f"got {self.draft_sample_method!r}")
        if self.rejection_sample_method not in REJECTION_SAMPLE_METHODS:
            raise ValueError(f"rejection_sample_method must be one of {', '.join(REJECTION_SAMPLE_METHODS)}, "
                             f"got {self.rejection_sample_method!r}")
        self._check_synthetic()
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 2:
            raise ValueError(f"disable_by_batch_size must be >= 2 (a batch of one always speculates), "
                             f"got {self.disable_by_batch_size}")
        if self.confidence_threshold is not None:
            if self.method == "ngram" and self.rejection_sample_method == "synthetic" and self.confidence_threshold:
                raise ValueError("confidence_threshold does not apply to n-gram drafts under rejection_sample_method "
                                 "'synthetic' (its curve judges no draft: every step verifies num_speculative_tokens)")
            if not 0.0 <= self.confidence_threshold <= 1.0:
                raise ValueError(f"confidence_threshold must be in [0, 1], got {self.confidence_threshold}")
        elif self.method == "ngram" and self.rejection_sample_method != "synthetic":
            self.confidence_threshold = DEFAULT_NGRAM_CONFIDENCE

    def _check_counts(self) -> None:
        k = self.num_speculative_tokens
        if k is None:
            if self.method == "ngram":
                raise ValueError("method 'ngram' needs num_speculative_tokens")
            return
        if not 1 <= k <= MAX_SPEC_TOKENS:
            raise ValueError(f"num_speculative_tokens must be in [1, {MAX_SPEC_TOKENS}], got {k}")

    def _resolve_lookup(self) -> None:
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if lo is None and hi is None:
            lo = hi = DEFAULT_PROMPT_LOOKUP
        lo = hi if lo is None else lo
        hi = lo if hi is None else hi
        if lo < 1 or hi < 1:
            raise ValueError(f"prompt_lookup_min and prompt_lookup_max must be >= 1, got {lo} and {hi}")
        if lo > hi:
            raise ValueError(f"prompt_lookup_min ({lo}) must not exceed prompt_lookup_max ({hi})")
        self.prompt_lookup_min, self.prompt_lookup_max = lo, hi

    def _check_synthetic(self) -> None:
        rates, length = self.synthetic_acceptance_rates, self.synthetic_acceptance_length
        if self.rejection_sample_method != "synthetic":
            if rates is not None or length is not None:
                raise ValueError("synthetic_acceptance_rates/length need rejection_sample_method 'synthetic'")
            return
        if (rates is None) == (length is None):
            raise ValueError("rejection_sample_method 'synthetic' needs exactly one of "
                             "synthetic_acceptance_rates and synthetic_acceptance_length")
        k = self.num_speculative_tokens
        if k is None:
            raise ValueError("rejection_sample_method 'synthetic' needs num_speculative_tokens")
        if length is not None:
            if not 1.0 <= length <= k + 1:
                raise ValueError(f"synthetic_acceptance_length must be in [1, {k + 1}], got {length}")
            self.synthetic_acceptance_rates = rates_for_length(length, k)
            return
        if len(rates) != k:
            raise ValueError(f"synthetic_acceptance_rates must have {k} entries (num_speculative_tokens), "
                             f"got {len(rates)}")
        if not all(0.0 <= r <= 1.0 for r in rates):
            raise ValueError(f"synthetic_acceptance_rates entries must be in [0, 1], got {rates}")
        if any(b > a for a, b in zip(rates, rates[1:])):
            raise ValueError(f"synthetic_acceptance_rates must be non-increasing, got {rates}")
        self.synthetic_acceptance_rates = [float(r) for r in rates]


def rates_for_length(length: float, k: int) -> list[float]:
    """The least-variance curve with mean accepted length `length` (bonus included): the first
    floor(length - 1) drafts always pass, the next with the fractional remainder, the rest never."""
    drafts = length - 1.0
    full = math.floor(drafts)
    return ([1.0] * full + [drafts - full] + [0.0] * k)[:k]


_FIELDS = {f.name: f for f in dataclasses.fields(SpeculativeConfig)}
_STR, _INT, _NUM = ((str,), "a string"), ((int,), "an integer"), ((int, float), "a number")
_TYPES: dict[str, tuple[tuple[type, ...], str]] = {
    "method": _STR, "model": _STR, "draft_sample_method": _STR, "rejection_sample_method": _STR,
    "num_speculative_tokens": _INT, "prompt_lookup_min": _INT, "prompt_lookup_max": _INT, "disable_by_batch_size": _INT,
    "synthetic_acceptance_length": _NUM, "confidence_threshold": _NUM,
    "synthetic_acceptance_rates": ((list,), "a list of numbers"),
}


def parse_speculative_config(value: str | dict[str, Any] | None) -> SpeculativeConfig | None:
    """The `--speculative-config` JSON object (or an `LLM(speculative_config=...)` dict); None stays None.
    Raises ValueError naming the bad key or value."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"--speculative-config is not valid JSON: {e.msg} (at character {e.pos})") from None
    if not isinstance(value, dict):
        raise ValueError("--speculative-config must be a JSON object, e.g. "
                         '\'{"method": "ngram", "num_speculative_tokens": 4}\'')
    unknown = sorted(set(value) - set(_FIELDS))
    if unknown:
        raise ValueError(f"unknown speculative config key(s) {', '.join(map(repr, unknown))}; "
                         f"known: {', '.join(_FIELDS)}")
    if "method" not in value:
        raise ValueError(f"speculative config needs 'method' (one of {', '.join(METHODS)})")
    for key, v in value.items():
        _check_type(key, v)
    return SpeculativeConfig(**value)


def _check_type(key: str, v: Any) -> None:
    if v is None and key != "method":
        return
    types, what = _TYPES[key]
    # JSON true/false are ints to Python; no key here is a boolean
    ok = isinstance(v, types) and not isinstance(v, bool)
    if ok and key == "synthetic_acceptance_rates":
        ok = all(isinstance(r, (int, float)) and not isinstance(r, bool) for r in v)
    if not ok:
        raise ValueError(f"speculative config '{key}' must be {what}, got {json.dumps(v)}")


def check_for_engine(value: str | dict[str, Any] | SpeculativeConfig, cfg: Any) -> SpeculativeConfig:
    """The parsed config of `EngineConfig.speculative_config`, refusing by name what the engine does not
    build yet (a refusal, never a silent fallback to plain decoding). `cfg` is the EngineConfig. A dspark
    config without num_speculative_tokens gets the drafter's block size."""
    spec = value if isinstance(value, SpeculativeConfig) else parse_speculative_config(value)
    if spec.method == "dspark":
        spec = _check_dspark(spec, cfg)
    elif spec.draft_sample_method != "greedy":
        raise ValueError("draft_sample_method 'probabilistic' needs a drafter with a distribution; n-gram drafts "
                         "are one-hot (leave it 'greedy')")
    if cfg.tensor_parallel_size > 1:
        raise ValueError("speculative decoding is not supported with tensor_parallel_size > 1 yet")
    budget = cfg.max_num_batched_tokens
    if budget is not None and spec.num_speculative_tokens + 1 > budget:
        raise ValueError(f"num_speculative_tokens + 1 ({spec.num_speculative_tokens + 1}) exceeds "
                         f"max_num_batched_tokens ({budget}): a verify step could never be scheduled")
    return spec


def _check_dspark(spec: SpeculativeConfig, cfg: Any) -> SpeculativeConfig:
    path = os.path.join(spec.model, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"speculative model {spec.model!r}: no config.json there (a DSpark drafter directory)")
    with open(path) as f:
        block = json.load(f).get("block_size")
    k = spec.num_speculative_tokens
    if not isinstance(block, int) or block < 1:
        raise ValueError(f"speculative model {spec.model!r}: its config.json has no block_size")
    if k is not None and k > block:
        raise ValueError(f"num_speculative_tokens ({k}) exceeds the drafter's block size ({block})")
    return dataclasses.replace(spec, num_speculative_tokens=k or block)
