"""N-gram prompt lookup: drafts copied from the request's own history, no model (vLLM's `ngram`).

For each request, find the longest n in [prompt_lookup_min, prompt_lookup_max] for which the last n
tokens occur earlier in the history (prompt and output); propose up to k tokens that followed that
earlier occurrence, never past the end of the history or the model length. Among occurrences of that
longest n the earliest wins, as vLLM's matcher picks it (its tests: "always pick the first one").

The whole batch is matched at once: histories are padded into one [B, L] tensor and a match of the
last n tokens ending at position e is built up one n at a time, M_n[e] = M_(n-1)[e] and
(t[e-n+1] == t[T-n]), so the cost is max_n elementwise passes over the padded history.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

_PAD = -1  # after a history's end
_BEFORE = -2  # before its start (never equal to a token or to _PAD)


class NgramProposer:
    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int, num_speculative_tokens: int,
                 max_model_len: int):
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max")
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max
        self.k, self.max_model_len = num_speculative_tokens, max_model_len

    def propose(self, histories: Sequence[Sequence[int]]) -> list[list[int]]:
        """Drafts for each history (prompt + output tokens so far); [] where nothing matches."""
        if not histories:
            return []
        lens = torch.tensor([len(h) for h in histories], dtype=torch.long)
        width = max(int(lens.max()), 1)
        tokens = torch.full((len(histories), width), _PAD, dtype=torch.long)
        for i, h in enumerate(histories):
            if h:
                tokens[i, : len(h)] = torch.as_tensor(h, dtype=torch.long)
        start, n = self.match(tokens, lens)
        budget = torch.clamp(torch.minimum(self.max_model_len - lens, torch.full_like(lens, self.k)), min=0)
        out = []
        for i, h in enumerate(histories):
            s, count = int(start[i]), int(budget[i])
            out.append(list(h[s : s + count]) if n[i] > 0 and count > 0 else [])
        return out

    def match(self, tokens: torch.Tensor, lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """For padded histories [B, L] of lengths [B]: (index where the proposal starts, matched n;
        n is 0 where no n in range matches)."""
        b, width = tokens.shape
        ends = torch.arange(width).unsqueeze(0)  # e: where an earlier occurrence ends
        # an occurrence must leave at least one token after it before the history's end
        room = ends <= (lens - 2).unsqueeze(1)
        live = torch.ones(b, width, dtype=torch.bool)
        best_n = torch.zeros(b, dtype=torch.long)
        best_start = torch.zeros(b, dtype=torch.long)
        rows = torch.arange(b)
        for n in range(1, self.max_n + 1):
            has_n = lens >= n + 1
            want = tokens[rows, (lens - n).clamp(min=0)]  # t[T-n]
            shifted = F.pad(tokens, (n - 1, 0), value=_BEFORE)[:, :width]  # t[e-n+1] at e
            live &= shifted == want.unsqueeze(1)
            if n < self.min_n:
                continue
            found = live & room & has_n.unsqueeze(1)
            hit = found.any(dim=1)
            first = found.int().argmax(dim=1)  # the earliest end, i.e. the earliest occurrence
            best_n = torch.where(hit, n, best_n)
            best_start = torch.where(hit, first + 1, best_start)
        return best_start, best_n
