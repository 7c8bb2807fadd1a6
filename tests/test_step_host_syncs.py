"""A mixed step's forward reads its sequence offsets from the host lists the step-input builder already
has, never back from the device tensor (a readback is a host sync per layer on the GPU): the fast MLA path
(prefill beside decodes) and the reference KDA / MLA / DSA paths."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hyserve.models.batch import Batch
from hyserve.ops.kernel_plan import REFERENCE_PLAN


class NoReadback(torch.Tensor):
    """A device tensor whose values must stay on the device: reading them into Python fails."""

    def tolist(self):
        raise AssertionError("cu_seqlens read back to the host")

    def item(self):
        raise AssertionError("cu_seqlens read back to the host")

    def cpu(self, *args, **kwargs):
        raise AssertionError("cu_seqlens copied to the host")


def mixed_batch() -> Batch:
    # a decode over 20 tokens, a 12-token chunk over 18 cached ones, a fresh 9-token prefill
    batch = Batch.build([1, 12, 9], [20, 30, 9], [[0, 1], [2, 3], [4]], 16, [0, 1, 2], [False, False, True])
    return dataclasses.replace(batch, cu_seqlens=batch.cu_seqlens.as_subclass(NoReadback))


def run(model, plan, batch: Batch, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    cache = model.make_cache(5, 16, 3)
    cache.pages.normal_(generator=gen)
    cache.conv.normal_(generator=gen)
    cache.recurrent.normal_(0, 0.1, generator=gen)
    ids = torch.randint(0, model.config.vocab_size, (batch.num_tokens,), generator=gen)
    with torch.inference_mode():
        return model(ids, batch, cache, plan)


@pytest.mark.parametrize("name", ["kimi-linear-tiny", "k3.1-tiny"])
def test_the_reference_forward_never_reads_cu_seqlens_back(tiny_model, name):
    model, _ = tiny_model(name)
    run(model, REFERENCE_PLAN, mixed_batch())


def test_the_fast_mla_path_of_a_mixed_step_never_reads_cu_seqlens_back_and_matches_the_reference(tiny_model):
    model, _ = tiny_model("kimi-linear-tiny")
    fast = dataclasses.replace(REFERENCE_PLAN, mla="merged")  # q|kv_a GEMM, row-write kernel, SDPA prefill
    assert fast.mla_path(torch.float32, torch.float32) == "merged"
    got = run(model, fast, mixed_batch())
    want = run(model, REFERENCE_PLAN, mixed_batch())
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
