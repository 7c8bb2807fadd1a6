"""Greedy generation on the GPU (every fast path: fla prefill, Triton decode kernels, CUDA graphs) against
transformers' KimiLinearForCausalLM run on the CPU in float32, 32 tokens, on a tiny random checkpoint
(issue 6, item 3). The helpers are test_hf_parity's, which checks the same on the CPU."""

from __future__ import annotations

import importlib
import sys

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


def torch_only_kimi_linear() -> type:
    """transformers' KimiLinearForCausalLM on its PyTorch path. With fla-core importable, transformers binds
    fla's Triton kernels when the module is imported, and those refuse CPU tensors; importing it afresh
    with fla hidden keeps the oracle on the CPU, in exact float32 and without autotuning."""
    name = "transformers.models.kimi_linear.modeling_kimi_linear"
    saved = {k: sys.modules.pop(k) for k in list(sys.modules) if k == name or k == "fla" or k.startswith("fla.")}
    sys.modules["fla"] = None  # makes `import fla` raise ImportError
    try:
        return importlib.import_module(name).KimiLinearForCausalLM
    finally:
        sys.modules.pop(name, None)
        del sys.modules["fla"]
        sys.modules.update(saved)
        if name in saved:  # the package attribute too, which the fresh import rebound
            setattr(sys.modules[name.rpartition(".")[0]], name.rpartition(".")[2], saved[name])


@pytest.mark.parametrize("name", ["h4-two-mla-qlora", "h3-mla-last"])
def test_greedy_on_the_gpu_matches_transformers(name, tmp_path):
    torch.manual_seed(0)
    model = torch_only_kimi_linear()(_hf_config(CONFIGS[name])).float().eval()
    _randomize(model, seed=sorted(CONFIGS).index(name))
    model.save_pretrained(tmp_path)
    prompt = torch.randint(3, 101, (PROMPT_LEN,), generator=torch.Generator().manual_seed(1))[:24].tolist()
    want, logits = transformers_greedy(model, prompt, GREEDY_TOKENS)
    # fla's kernels multiply fp32 tiles as TF32 (about 1e-3 relative): a flip is allowed only at a near tie
    assert_greedy_matches(hyserve_greedy(tmp_path, prompt, GREEDY_TOKENS, "cuda"), want, logits, tol=1e-2)
