"""The engine on NCCL ranks, one GPU each (needs 2 GPUs; the CPU suite proves the same on gloo): the
logits every step hands the sampler match one GPU's engine, with CUDA graphs captured on every rank (but
under DCP, whose attention is torch code) and async scheduling on (CUDA's defaults), and greedy generation
through `LLM` gives the same tokens."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from dist_util import LogitsRecorder, worst_step_error  # noqa: E402

from hyserve import LLM, SamplingParams  # noqa: E402

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = pytest.mark.skipif(GPUS < 2, reason="needs 2 CUDA GPUs")

PROMPTS = [list(range(3, 40)), [5, 6], list(range(100, 117))]
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
COMMON = dict(dtype="float32", kv_cache_memory_bytes=256 << 20, max_num_seqs=8, block_size=16,
              max_num_batched_tokens=32)
LAYOUTS = {"tp2": dict(tensor_parallel_size=2), "tp2-ep": dict(tensor_parallel_size=2, enable_expert_parallel=True),
           "dcp2": dict(tensor_parallel_size=2, decode_context_parallel_size=2)}


def _run(llm: LLM):
    rec = LogitsRecorder(llm.engine)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return rec.steps, [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("preset", ["k3-tiny", "k3.1-tiny"])
def test_engine_on_two_gpus_matches_one_gpu(preset, layout):
    fields = LAYOUTS[layout]
    block = COMMON["block_size"] * fields.get("decode_context_parallel_size", 1)
    ref_steps, ref_tokens = _run(LLM(preset, **{**COMMON, "block_size": block}))
    llm = LLM(preset, **COMMON, **fields)
    try:
        if layout != "dcp2":  # the DCP attention is torch code that reads lengths on the host: it runs eagerly
            assert llm.engine.runner.graphs.graphs, "no graph captured on the ranks"
        steps, tokens = _run(llm)
    finally:
        llm.engine.model.close()
    assert worst_step_error(steps, ref_steps) < 1e-4
    assert tokens == ref_tokens
