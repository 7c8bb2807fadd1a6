"""Synthetic request datasets for `bench serve`.

Prompts are random token ids in [vocab_low, vocab_high] so /v1/completions gets exact input lengths
(no tokenizer round trip). The chat endpoint needs text; there each id is rendered as one character
(ids 32..126 are printable ASCII, which a byte-level tokenizer maps back to one token each).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

LENGTH_DISTRIBUTIONS = ("fixed", "uniform", "lognormal")

# Defaults fit a 512-token byte-level vocab: printable ASCII bytes survive decode -> encode.
DEFAULT_VOCAB_LOW = 32
DEFAULT_VOCAB_HIGH = 126


@dataclass
class SampleRequest:
    prompt_ids: list[int]
    output_len: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)


def sample_lengths(
    rng: np.random.Generator, n: int, mean: int, dist: str, range_ratio: float = 0.0, sigma: float = 0.5
) -> np.ndarray:
    """`n` positive lengths around `mean`.

    fixed: all equal; uniform: [mean*(1-r), mean*(1+r)]; lognormal: median `mean`, shape `sigma`,
    clipped to [1, 8*mean] so one draw cannot blow past a small model's context.
    """
    if mean < 1:
        raise ValueError(f"length must be >= 1, got {mean}")
    if dist == "fixed" or (dist == "uniform" and range_ratio <= 0):
        return np.full(n, mean, dtype=np.int64)
    if dist == "uniform":
        if not 0 <= range_ratio < 1:
            raise ValueError(f"range ratio must be in [0, 1), got {range_ratio}")
        lo = max(1, int(round(mean * (1 - range_ratio))))
        hi = max(lo, int(round(mean * (1 + range_ratio))))
        return rng.integers(lo, hi + 1, size=n)
    if dist == "lognormal":
        draws = rng.lognormal(mean=np.log(mean), sigma=sigma, size=n)
        return np.clip(np.round(draws), 1, 8 * mean).astype(np.int64)
    raise ValueError(f"unknown length distribution {dist!r}; choose from {LENGTH_DISTRIBUTIONS}")


def random_dataset(
    num_prompts: int,
    input_len: int,
    output_len: int,
    *,
    dist: str = "fixed",
    range_ratio: float = 0.0,
    sigma: float = 0.5,
    vocab_low: int = DEFAULT_VOCAB_LOW,
    vocab_high: int = DEFAULT_VOCAB_HIGH,
    seed: int = 0,
) -> list[SampleRequest]:
    """Random-token prompts with lengths from `dist`; deterministic for a given seed."""
    if vocab_high < vocab_low:
        raise ValueError("vocab_high must be >= vocab_low")
    rng = np.random.default_rng(seed)
    ins = sample_lengths(rng, num_prompts, input_len, dist, range_ratio, sigma)
    outs = sample_lengths(rng, num_prompts, output_len, dist, range_ratio, sigma)
    return [
        SampleRequest(rng.integers(vocab_low, vocab_high + 1, size=int(i)).tolist(), int(o))
        for i, o in zip(ins, outs)
    ]


def ids_to_text(ids: list[int]) -> str:
    """Render ids as characters for text-only endpoints; exact only for byte-level vocabularies."""
    return "".join(chr(i) if 32 <= i < 127 else " " for i in ids)
