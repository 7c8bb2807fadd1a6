"""Fixed-shape training batches: every step is `rows` rows of exactly `row_len` tokens.

Why fixed: each distinct shape costs the GPU path something once (a cuDNN attention plan, a Triton
specialisation, an allocator pattern), and with whole-example batches nearly every step was new. Here
every step has the same token count and the same number of sequences (one per row), so the kernels
are compiled and tuned in the warm-up step and never again.

Examples are packed whole into rows (first fit over a few open rows), and the rest of a row is padding.
A row is one sequence for the model (its KDA state and attention run across the examples packed in
it, as in GPT-style packing); the loss never asks a token to predict the first token of the next
example, nor padding. Examples longer than a row are cut into row-sized pieces.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

IGNORE = -100  # F.cross_entropy's ignore_index
OPEN_ROWS = 8  # first fit over this many partly filled rows: less padding than one open row


@dataclass
class RowBatch:
    ids: torch.Tensor  # [rows * row_len] long, rows laid end to end
    targets: torch.Tensor  # [rows * row_len] long: the next token where it is trained on, else IGNORE
    rows: int
    row_len: int

    @property
    def trained_tokens(self) -> int:
        return int((self.targets != IGNORE).sum())


def row_targets(ids: Sequence[int], mask: Sequence[int]) -> list[int]:
    """Targets of one example in place: position j predicts ids[j+1] where mask[j+1] is set; the last
    position predicts nothing (the next thing in the row belongs to another example)."""
    out = [ids[j + 1] if mask[j + 1] else IGNORE for j in range(len(ids) - 1)]
    return out + [IGNORE] if ids else out


def pieces(examples: Sequence[tuple[list[int], list[int]]], row_len: int) -> list[tuple[list[int], list[int]]]:
    """(ids, targets) per example, cut into pieces of at most `row_len` tokens; pieces that train on
    nothing are dropped."""
    out = []
    for ids, mask in examples:
        tgt = row_targets(ids, mask)
        for i in range(0, len(ids), row_len):
            t = tgt[i : i + row_len]
            t[-1] = IGNORE  # a cut piece's last token would predict the first of the next piece
            if any(x != IGNORE for x in t):
                out.append((ids[i : i + row_len], t))
    return out


def packed_rows(
    items: Sequence[tuple[list[int], list[int]]], row_len: int, pad_id: int, rng: random.Random,
) -> Iterator[tuple[list[int], list[int]]]:
    """Endless rows of exactly `row_len` (ids, targets), from `items` in a fresh shuffle each epoch."""
    if not items:
        raise ValueError("no training examples")
    while True:
        order = list(range(len(items)))
        rng.shuffle(order)
        open_rows: list[tuple[list[int], list[int]]] = []
        for i in order:
            ids, tgt = items[i]
            row = next((r for r in open_rows if len(r[0]) + len(ids) <= row_len), None)
            if row is None:
                if len(open_rows) == OPEN_ROWS:  # emit the fullest to make room
                    open_rows.sort(key=lambda r: len(r[0]))
                    yield _padded(open_rows.pop(), row_len, pad_id)
                row = ([], [])
                open_rows.append(row)
            row[0].extend(ids)
            row[1].extend(tgt)
        for row in open_rows:  # an epoch's leftovers: rows never span epochs
            yield _padded(row, row_len, pad_id)


def _padded(row: tuple[list[int], list[int]], row_len: int, pad_id: int) -> tuple[list[int], list[int]]:
    n = row_len - len(row[0])
    return row[0] + [pad_id] * n, row[1] + [IGNORE] * n


def row_batches(
    examples: Sequence[tuple[list[int], list[int]]], rows: int, row_len: int, pad_id: int, seed: int = 0,
) -> Iterator[RowBatch]:
    """Endless RowBatches, all of shape [rows * row_len]."""
    stream = packed_rows(pieces(examples, row_len), row_len, pad_id, random.Random(seed))
    while True:
        chunk = [next(stream) for _ in range(rows)]
        yield RowBatch(
            ids=torch.tensor([t for r in chunk for t in r[0]], dtype=torch.long),
            targets=torch.tensor([t for r in chunk for t in r[1]], dtype=torch.long),
            rows=rows, row_len=row_len,
        )
