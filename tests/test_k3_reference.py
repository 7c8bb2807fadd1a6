"""The K3 reference vector (/work/shared/vectors/README.md): what Moonshot's K3 modeling code computes, in
float32 on the CPU, for the tiny released-format checkpoint in tests/data/k3-public."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hyserve.models import KimiForCausalLM, load_model
from hyserve.models.batch import Batch

DATA = Path(__file__).parent / "data" / "k3-public"
REL_TOL = 1e-4


@pytest.fixture(scope="module")
def model() -> KimiForCausalLM:
    return load_model(str(DATA), dtype="float32")


@pytest.fixture(scope="module")
def reference() -> dict[str, torch.Tensor]:
    return load_file(str(DATA / "reference.safetensors"))


@torch.inference_mode()
def greedy(model: KimiForCausalLM, prompt: list[int], n: int, block_size: int = 16) -> list[int]:
    """Prefill the prompt once, then decode one token per step from the cache, as the engine does."""
    blocks = list(range((len(prompt) + n + block_size - 1) // block_size))
    cache = model.make_cache(len(blocks), block_size, 1)
    out: list[int] = []
    step, ctx, fresh = list(prompt), 0, True
    while len(out) < n:
        ctx += len(step)
        batch = Batch.build([len(step)], [ctx], [blocks], block_size, [0], [fresh])
        hidden = model(torch.tensor(step), batch, cache)
        tok = int(model.compute_logits(hidden[-1:]).argmax(-1))
        out.append(tok)
        step, fresh = [tok], False
    return out


def test_logits_match_reference_within_1e4_relative(model, reference):
    want = reference["logits"]
    got = model.score(reference["input_ids"].tolist())
    assert got.shape == want.shape
    rel = float((got - want).abs().max() / want.abs().max())
    assert rel < REL_TOL, f"max abs err / max abs logit = {rel:.2e}"


def test_greedy_continuation_matches_reference(model, reference):
    n = int(reference["greedy_prompt_len"][0])
    prompt = reference["input_ids"][:n].tolist()
    want = reference["greedy"].tolist()
    assert greedy(model, prompt, len(want)) == want
