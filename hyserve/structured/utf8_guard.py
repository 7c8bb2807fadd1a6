"""Keeps constrained text valid UTF-8 across token boundaries.

xgrammar matches characters byte by byte and takes byte sequences UTF-8 forbids when a character spans
tokens: a surrogate (ED A0..BF ..), an overlong form (E0 80..9F .., F0 80..8F ..), a code point past
U+10FFFF (F4 90.. ..). Decoded, each such byte turns into U+FFFD, which changes the text the grammar
checked (a string's length, an enum value). This guard follows the bytes the completion wrote and masks
tokens whose first byte cannot come next; it cannot reject a token the grammar needs, since every
character the grammar takes has a valid encoding.
"""

from __future__ import annotations

import torch

# A lead byte -> (continuation bytes that follow it, the allowed range of the first one).
_LEADS: dict[int, tuple[int, int, int]] = {}
for _b in range(0xC2, 0xE0):
    _LEADS[_b] = (1, 0x80, 0xBF)
for _b in range(0xE0, 0xF0):
    _LEADS[_b] = (2, 0xA0 if _b == 0xE0 else 0x80, 0x9F if _b == 0xED else 0xBF)
for _b in range(0xF0, 0xF5):
    _LEADS[_b] = (3, 0x90 if _b == 0xF0 else 0x80, 0x8F if _b == 0xF4 else 0xBF)


def first_bytes(vocab: list[bytes], skip: set[int]) -> torch.Tensor:
    """Per token id, the first of its bytes; -1 for tokens with no bytes and for the ids in `skip`."""
    return torch.tensor([data[0] if data and tid not in skip else -1 for tid, data in enumerate(vocab)],
                        dtype=torch.int16)


class Utf8Guard:
    """The UTF-8 state after the bytes seen so far, and the tokens that may follow."""

    def __init__(self, first: torch.Tensor) -> None:
        self.first = first
        self.need = 0  # continuation bytes still due
        self.lo, self.hi = 0x80, 0xBF

    def feed(self, data: bytes) -> None:
        for b in data:
            if self.need:
                self.need -= 1
                self.lo, self.hi = 0x80, 0xBF
            elif b in _LEADS:
                self.need, self.lo, self.hi = _LEADS[b]

    def allowed(self, vocab_size: int) -> torch.Tensor:
        """Tokens whose first byte may come next (tokens without bytes are left to the grammar)."""
        first = self.first[:vocab_size].to(torch.int32)
        if self.need:
            ok = (first >= self.lo) & (first <= self.hi)
        else:
            ok = (first < 0x80) | ((first >= 0xC2) & (first <= 0xF4))
        return ok | (first < 0)
