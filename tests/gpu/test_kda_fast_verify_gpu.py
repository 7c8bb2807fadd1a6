"""Speculative verify rows on the GPU fast path (`kda_fast.kda_forward_fast` through the Triton
`kda_verify_multi`, as the device's kernel plan picks it): a KDA layer of the 48B shape against the layer's
reference path on the same GPU, and greedy generation with n-gram speculation equal to plain decoding on
kimi-linear-tiny. tests/test_kda_fast_verify_interpret.py runs the layer check under Triton's CPU
interpreter."""

from __future__ import annotations

import gc

import pytest
import torch
from kda_step_util import STEP, STEP_WITH_PREFILLS, kda_layer, rel_err, run_both, verify_step

from hyserve import LLM
from hyserve.models.config import parse_config
from hyserve.models.presets import preset_config
from hyserve.ops.device_spec import DeviceSpec
from hyserve.ops.kernel_plan import plan_kernels

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
PRESET = "kimi-linear-48b-a3b"  # 32 heads of 128


def device_plan(dtype: torch.dtype):
    return plan_kernels(parse_config(preset_config(PRESET)), DeviceSpec.of("cuda"), dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("step", [STEP, STEP_WITH_PREFILLS], ids=["verify+decode", "verify+decode+prefill"])
def test_a_48b_kda_layer_step_with_verify_rows_equals_the_reference(dtype, step, monkeypatch):
    plan = device_plan(dtype)
    assert plan.kda_verify == "triton"
    if step is STEP_WITH_PREFILLS and plan.kda_prefill != "fla":
        pytest.skip("needs fla-core for the prefill chunks")
    layer = kda_layer(PRESET, dtype, "cuda", seed=1)
    x, batch, cache = verify_step(layer, dtype, "cuda", seed=2, step=step)
    ref, ref_cache, out, fast_cache, calls = run_both(layer, x, batch, cache, monkeypatch, plan)
    torch.cuda.synchronize()
    assert calls == {"decode": 1, ("verify", 2): 1, ("verify", 3): 1}
    # the decode and verify sequences' rows and slots: fp32 GEMMs and kernels, no TF32
    rows, slots = _rows_and_slots(batch, step)
    tight = 2e-2 if dtype == torch.bfloat16 else 1e-4
    assert rel_err(out[rows], ref[rows]) < tight
    assert rel_err(fast_cache.recurrent[slots], ref_cache.recurrent[slots]) < tight
    assert rel_err(fast_cache.conv[slots], ref_cache.conv[slots]) < tight  # merged q|k|v GEMM vs three GEMMs
    # the whole step, prefill chunks included (fla's chunk kernels take fp32 dots in TF32)
    assert rel_err(out, ref) < 2e-2
    assert rel_err(fast_cache.recurrent, ref_cache.recurrent) < 2e-2
    assert rel_err(fast_cache.conv, ref_cache.conv) < 2e-2


def _rows_and_slots(batch, step) -> tuple[torch.Tensor, torch.Tensor]:
    """Token rows and state slots of the step's decode and verify sequences (every column of a slot row)."""
    cu, plain = batch.cu_seqlens_host, [i for i, s in enumerate(step) if s[0] == "decode"]
    seqs = plain + batch.verify.seqs
    rows = torch.tensor([r for i in seqs for r in range(cu[i], cu[i + 1])], device="cuda")
    idx = torch.tensor(plain, device="cuda", dtype=torch.long)
    return rows, torch.cat([batch.state_slots[idx], batch.verify.slot_table.reshape(-1)])


def test_ngram_greedy_output_on_cuda_equals_plain_decoding(monkeypatch):
    """kimi-linear-tiny on CUDA with the real n-gram proposer and with an oracle that accepts and rejects:
    the verify steps run the Triton verify kernel, and the output is plain decoding's."""
    from test_spec_engine import GREEDY, NGRAM, Oracle, repetitive_prompts, run

    from hyserve.models.layers import kda_fast

    calls, kernel = [], kda_fast.kda_verify_multi

    def counted(*args, **kw):
        calls.append(args[-1])  # the group's tokens per sequence
        return kernel(*args, **kw)

    monkeypatch.setattr(kda_fast, "kda_verify_multi", counted)
    prompts = repetitive_prompts(6, seed=3) + [[5, 17, 99, 3], list(range(40, 140))]
    kw = dict(device="cuda", max_num_batched_tokens=64)
    llm = LLM("kimi-linear-tiny", **kw)
    plain = run(llm, prompts)
    for oracle in (False, True):
        llm = None  # the last engine's cache took most of the GPU's memory
        gc.collect()
        torch.cuda.empty_cache()
        llm = LLM("kimi-linear-tiny", speculative_config=NGRAM, **kw)
        if oracle:
            llm.engine.spec.proposer = Oracle({tuple(p): o for p, o in zip(prompts, plain)})
        assert run(llm, prompts, GREEDY) == plain
        st = llm.engine.stats.spec_decode
        assert st.num_draft_tokens > 0 and calls, "no verify step reached the Triton verify kernel"
        if oracle:
            assert 0 < st.num_accepted_tokens < st.num_draft_tokens
        calls.clear()
