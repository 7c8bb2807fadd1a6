"""How many n-gram drafts a step verifies: from each request's measured acceptance, and only when the drafts
pay for the step they make (docs/speculative_decoding.md, "Draft budget").

An n-gram drafter has no confidence head, so a request's own record stands in for one: decayed counts of its
verified drafts' outcomes give its acceptance rate a = (hits + 1) / (trials + 1) (one optimistic pseudo-trial),
and draft j's predicted survival is a^(j+1). A request verifies the prefix of drafts whose survival clears
the config's `confidence_threshold`. The rate comes from earlier steps only, never from
the drafts being judged, so this is a causal stopping rule (confidence.py) and outputs stay exact.

A step's drafts must also pay: the tokens a row is expected to emit, 1 + the mean survival sum, must reach
the step's cost ratio, the time of a verify step of B rows of q tokens (a verify graph pads every row to
1 + the most drafts) over a plain decode of B rows, from the step cost model (the weights and routed experts
the tokens read, plus a fixed step overhead and the host work a verify step waits for). A batch where one
request drafts pads all the others, so under load few drafts never pay. When even every request drafting
its full k could not pay, the engine does not wait for a step's tokens to draft (async scheduling overlaps
the steps again).

A turned-down n-gram request keeps being judged at no cost (shadow trials), and a new one starts there, with
no record (a verify step of drafts that miss costs a batch-wide padded step): its first draft is remembered
(`expect`) and scored against the token the target emits there (`judge`), which is what verifying it would
have given (equal to the greedy token; for a sampled one, equal with the probability a one-hot draft is
accepted with). So its rate follows its text: it drafts again as soon as its drafts would pass, and a
request whose drafts keep missing is not retried. Counts of a request with no such trial (no draft to
remember: a drafter without shadow trials, or no n-gram match) decay every step it verifies nothing, so it
is tried again later; requests decay together, so their retries land in the same step.

DSpark drafts (engine_dspark.py) take the same budget with threshold 0: their confidence head, when
configured, cuts the prefix per block, so only the measured rates and the pay rule apply, and a verify
step also pays for the drafter's own forward (`drafted_step_seconds`).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass

# decay of a request's counts per verify step it takes part in (about the last ten steps weigh), and per
# step it verifies nothing (a request turned down after a few misses is tried again some 20-40 steps later)
VERIFY_DECAY = 0.9
IDLE_DECAY = 0.99
# the step cost model's time of a graph-replayed step is weight bytes / copy bandwidth + this (the 48B
# shape's batch-1 decode: 2.52 ms against a 1.52 ms floor on the H200), and a verify step adds the host
# work between two steps that it waits for (readback, rejection, landing, drafting: 0.3 ms measured there)
STEP_OVERHEAD_S = 1.0e-3
VERIFY_WAIT_S = 0.3e-3

StepSeconds = Callable[[int, bool], float]  # (tokens, verify) -> seconds of a step


@dataclass
class _Tally:
    hits: float = 0.0
    trials: float = 0.0

    @property
    def rate(self) -> float:
        return (self.hits + 1.0) / (self.trials + 1.0)


def step_seconds(weight_bytes: Callable[[int], float], copy_bytes_per_s: float) -> StepSeconds:
    """A step's time from the bytes its tokens read (`StepCostModel.weight_bytes`)."""
    return lambda tokens, verify: (weight_bytes(tokens) / copy_bytes_per_s + STEP_OVERHEAD_S
                                   + (VERIFY_WAIT_S if verify else 0.0))


def drafted_step_seconds(weight_bytes: Callable[[int], float], copy_bytes_per_s: float,
                         drafter_bytes: float) -> StepSeconds:
    """`step_seconds` for a drafter with a forward of its own (DSpark): a verify step also waits for one
    drafting call, costed like a graph-replayed step of its own, the `drafter_bytes` it reads (its weights
    and the target lm_head it shares for the draft logits: `DSparkDrafter.drafting_bytes`) / copy bandwidth +
    STEP_OVERHEAD_S. A plain step costs what it costs without speculation: it drafts nothing."""
    target = step_seconds(weight_bytes, copy_bytes_per_s)
    drafting = drafter_bytes / copy_bytes_per_s + STEP_OVERHEAD_S
    return lambda tokens, verify: target(tokens, verify) + (drafting if verify else 0.0)


class DraftBudget:
    """threshold: the survival a request's next draft needs (its prefix rule); 0 keeps every proposed
    draft, so that only the step's pay rule (and the rates it reads) decides. shadowed: the drafter's
    turned-down drafts are judged (`expect`/`judge`), so a request with no record yet drafts nothing: its
    first drafts are judged in the shadow, not probed by a verify step (without shadow trials a new request
    verifies its drafts once, the optimistic pseudo-trial)."""

    def __init__(self, threshold: float, seconds: StepSeconds, shadowed: bool = False):
        self.threshold, self.seconds, self.shadowed = threshold, seconds, shadowed
        self._tallies: dict[Hashable, _Tally] = {}
        self._expected: dict[Hashable, tuple[int, int]] = {}  # key -> (position, token) of a turned-down draft

    def rate(self, key: Hashable) -> float:
        """The request's acceptance rate per draft (1.0 before any verify)."""
        tally = self._tallies.get(key)
        return 1.0 if tally is None else tally.rate

    def lengths(self, keys: Sequence[Hashable], proposed: Sequence[int], batch: int) -> list[int]:
        """How many of each request's `proposed` drafts the next step verifies, in a step of `batch` rows
        (at least the requests given): each request's surviving prefix, or none at all where they do not pay."""
        rates = [self.rate(k) for k in keys]
        counts = [0 if self.shadowed and k not in self._tallies else self._prefix(a, n)
                  for k, a, n in zip(keys, rates, proposed)]
        return counts if self._pays(rates, counts, max(batch, len(keys), 1)) else [0] * len(counts)

    def may_draft(self, keys: Sequence[Hashable], k: int, batch: int) -> bool:
        """Whether the next step could verify drafts if every request proposed k (the engine waits for a
        step's tokens only then)."""
        return any(self.lengths(keys, [k] * len(keys), batch))

    def _prefix(self, rate: float, proposed: int) -> int:
        n, survival = 0, rate
        while n < proposed and survival >= self.threshold:
            n, survival = n + 1, survival * rate
        return n

    def _pays(self, rates: list[float], counts: list[int], batch: int) -> bool:
        q = 1 + max(counts, default=0)
        if q == 1:
            return False
        gain = sum(a * (1.0 - a**n) / (1.0 - a) if a < 1.0 else float(n) for a, n in zip(rates, counts))
        return (batch + gain) / batch >= self.seconds(batch * q, True) / self.seconds(batch, False)

    def record(self, key: Hashable, verified: int, accepted: int) -> None:
        """A verify step's outcome for the request: `accepted` of its `verified` drafts, then (if fewer) one
        rejection."""
        t = self._tallies.setdefault(key, _Tally())
        t.hits = VERIFY_DECAY * t.hits + accepted
        t.trials = VERIFY_DECAY * t.trials + accepted + (1 if accepted < verified else 0)

    def expect(self, key: Hashable, position: int, token: int) -> None:
        """The request's first draft, turned down, predicts `token` at `position` of its history."""
        self._expected[key] = (position, token)

    def judge(self, key: Hashable, history: Sequence[int]) -> bool:
        """Score the request's turned-down draft once `history` (prompt and output tokens, sliceable) holds its
        position: a trial of one draft, as a verify step would record it. True when a trial was recorded."""
        expected = self._expected.get(key)
        if expected is None or len(history) <= expected[0]:
            return False
        del self._expected[key]
        position, token = expected
        self.record(key, 1, int(history[position : position + 1][0] == token))
        return True

    def idle(self, key: Hashable) -> None:
        """A step in which the request verified nothing."""
        t = self._tallies.get(key)
        if t is not None:
            t.hits, t.trials = IDLE_DECAY * t.hits, IDLE_DECAY * t.trials

    def retain(self, keys: Iterable[Hashable]) -> None:
        """Forget every request not in `keys` (finished or aborted)."""
        keep = set(keys)
        for key in [k for k in self._tallies if k not in keep]:
            del self._tallies[key]
        for key in [k for k in self._expected if k not in keep]:
            del self._expected[key]

    def __len__(self) -> int:
        return len(self._tallies)
