"""The shared arrival counters of last-program-finishes kernels (hyserve/ops/arrival.py)."""

from __future__ import annotations

import torch

from hyserve.ops import arrival


def test_counters_start_zeroed_and_are_shared(monkeypatch):
    monkeypatch.setattr(arrival, "_BUFFERS", {})
    first = arrival.arrival_counters("cpu", 1)
    assert first.dtype == torch.int32 and int(first.count_nonzero()) == 0
    assert arrival.arrival_counters("cpu", first.numel()) is first


def test_growing_keeps_the_old_buffer_alive_for_captured_graphs(monkeypatch):
    monkeypatch.setattr(arrival, "_BUFFERS", {})
    first = arrival.arrival_counters("cpu", 1)
    grown = arrival.arrival_counters("cpu", first.numel() + 1)
    assert grown.numel() >= 2 * first.numel() and int(grown.count_nonzero()) == 0
    assert any(buf is first for buf in arrival._BUFFERS[torch.device("cpu")])
    assert arrival.arrival_counters("cpu", 5) is grown
