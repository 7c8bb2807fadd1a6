"""Engine steps by how they ran, with the tokens they computed and the wall time each held the engine
(`hyserve:engine_steps`, `hyserve:engine_step_tokens`, `hyserve:engine_step_seconds` on /metrics).

A step's time runs from its launch, or from the landing before it when that came later, to its own landing
(its sampled tokens read back). Under async scheduling steps land one after another while the GPU is busy,
so this is each step's share of the GPU's time; idle time between requests is never counted. A step that
samples nothing (prefill chunks only) lands without waiting for the GPU, so its time shows up in the
next step that samples. Kinds: "graph" (the decode graphs replayed) and "eager" (the model's forward,
with its MLP segment graphs where a size fits).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StepTimes:
    steps: dict[str, int] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    last_landing: float | None = None  # perf_counter seconds

    def landed(self, kind: str, num_tokens: int, launched: float, now: float) -> None:
        start = launched if self.last_landing is None else max(launched, self.last_landing)
        self.last_landing = now
        self.steps[kind] = self.steps.get(kind, 0) + 1
        self.tokens[kind] = self.tokens.get(kind, 0) + num_tokens
        self.seconds[kind] = self.seconds.get(kind, 0.0) + max(0.0, now - start)
