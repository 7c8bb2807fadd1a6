"""Greedy generation on the GPU (every fast path: fla prefill, Triton decode kernels, CUDA graphs) against
transformers' KimiLinearForCausalLM in float32, 32 tokens, on a tiny random checkpoint (issue 6, item 3).
transformers runs on the GPU too: with fla-core importable it binds fla's Triton kernels at import time,
and those refuse CPU tensors. The helpers are test_hf_parity's, which checks the same on the CPU."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
transformers = pytest.importorskip("transformers")

from test_hf_parity import (  # noqa: E402
    CONFIGS,
    GREEDY_TOKENS,
    PROMPT_LEN,
    _hf_config,
    _randomize,
    assert_greedy_matches,
    hyserve_greedy,
    transformers_greedy,
)
from transformers import KimiLinearForCausalLM  # noqa: E402


@pytest.mark.parametrize("name", ["h4-two-mla-qlora", "h3-mla-last"])
def test_greedy_on_the_gpu_matches_transformers(name, tmp_path):
    torch.manual_seed(0)
    model = KimiLinearForCausalLM(_hf_config(CONFIGS[name])).float().eval()
    _randomize(model, seed=sorted(CONFIGS).index(name))
    model.save_pretrained(tmp_path)
    prompt = torch.randint(3, 101, (PROMPT_LEN,), generator=torch.Generator().manual_seed(1))[:24].tolist()
    want, logits = transformers_greedy(model.cuda(), prompt, GREEDY_TOKENS)
    # fla's kernels multiply fp32 tiles as TF32 (about 1e-3 relative): a flip is allowed only at a near tie
    assert_greedy_matches(hyserve_greedy(tmp_path, prompt, GREEDY_TOKENS, "cuda"), want, logits, tol=1e-2)
