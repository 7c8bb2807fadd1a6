"""The hidden states of chosen target layers, read during a normal target forward (the DSpark
drafter's context features).

"The output of layer i" is the hidden state the model hands to layer i+1: with Block AttnRes (K3)
that is layer i+1's attention-residual mix, with the final one after the last layer. Those are
submodule calls inside the target's forward, so torch forward hooks read them without touching the
model's code; nothing is copied but the captured tensors. Models with plain residuals (Kimi Linear)
keep the stream in a local variable, so they need the model forward to return it: a named gap for the
engine integration (docs/speculative_decoding.md).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch import nn


def feature_modules(model: nn.Module, layer_ids: Sequence[int]) -> list[nn.Module]:
    """The submodule whose output is the hidden state after each of layer_ids (0-based)."""
    if not layer_ids:
        return []
    inner = model.model
    n = len(inner.layers)
    if not getattr(model.config, "attn_res_block_size", 0):
        raise NotImplementedError("target features are read from Block AttnRes mixes (K3 models); this model "
                                  "keeps its residual stream inside forward")
    mods = []
    for i in layer_ids:
        if not 0 <= i < n:
            raise ValueError(f"target layer {i} out of range: the model has {n} layers (0-based ids)")
        mods.append(inner.layers[i + 1].self_attention_res if i + 1 < n else inner.output_attn_res)
    return mods


class FeatureTap:
    """Holds the latest captured output of each tapped layer; `features()` concatenates them."""

    def __init__(self, n: int):
        self.outputs: list[torch.Tensor | None] = [None] * n

    def features(self) -> torch.Tensor:
        if any(o is None for o in self.outputs):
            raise RuntimeError("no target forward ran inside the tap")
        return torch.cat(self.outputs, -1)


@contextlib.contextmanager
def tap_features(model: nn.Module, layer_ids: Sequence[int]) -> Iterator[FeatureTap]:
    """Inside, every target forward records the hidden states after `layer_ids` ([T, D] each)."""
    tap = FeatureTap(len(layer_ids))
    handles = []
    for slot, mod in enumerate(feature_modules(model, layer_ids)):
        def hook(_mod, _inputs, out, slot=slot):
            tap.outputs[slot] = out
        handles.append(mod.register_forward_hook(hook))
    try:
        yield tap
    finally:
        for h in handles:
            h.remove()


def default_layer_ids(num_layers: int, count: int = 3) -> list[int]:
    """DFlash's choice: `count` layers spread evenly from layer 1 to layer L-3 (0-based)."""
    lo, hi = 1, max(1, num_layers - 3)
    if count == 1:
        return [(lo + hi) // 2]
    return sorted({round(lo + (hi - lo) * i / (count - 1)) for i in range(count)})
