"""Kimi Linear parity with transformers' `KimiLinearForCausalLM`, a test-only oracle (spec/models.md §2).

transformers runs its pure-PyTorch fallbacks here (`chunk_kda`, `causal_conv1d_fn`): fla-core and
causal-conv1d are not installed for the CPU tests, so nothing outside torch computes the oracle.
Every config puts MLA last, has a dense first layer and non-trivial gate/conv/norm/bias parameters.
The same weights are loaded three ways: the config.json transformers writes, the original remote-code
config format (1-based layer lists) and the transformers-5 runtime tensor names.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

transformers = pytest.importorskip("transformers")
from transformers import KimiLinearConfig, KimiLinearForCausalLM  # noqa: E402

from hyserve.models import load_model  # noqa: E402

PROMPT_LEN = 112
REL_TOL = 1e-4

# Different head counts and dims; the MLA layer is always last and layer 0 is always dense.
CONFIGS = {
    "h3-mla-last": dict(
        hidden_size=48, num_attention_heads=3, kv_lora_rank=20, qk_nope_head_dim=8, qk_rope_head_dim=4,
        v_head_dim=12, linear_num_heads=2, linear_head_dim=8, num_local_experts=6, num_experts_per_tok=2,
        n_shared_experts=1, layer_types=["linear_attention"] * 3 + ["full_attention"],
    ),
    "h4-two-mla-qlora": dict(
        hidden_size=64, num_attention_heads=4, kv_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=8, q_lora_rank=32, linear_num_heads=4, linear_head_dim=16, num_local_experts=8,
        num_experts_per_tok=3, n_shared_experts=2,
        layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention", "full_attention"],
    ),
    "h1-grouped-router": dict(
        hidden_size=40, num_attention_heads=2, kv_lora_rank=16, qk_nope_head_dim=12, qk_rope_head_dim=6,
        v_head_dim=10, linear_num_heads=5, linear_head_dim=8, num_local_experts=8, num_experts_per_tok=2,
        n_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=1.5,
        layer_types=["linear_attention", "linear_attention", "full_attention"],
    ),
}


def _hf_config(spec: dict) -> KimiLinearConfig:
    n = len(spec["layer_types"])
    return KimiLinearConfig(
        vocab_size=101, intermediate_size=72, moe_intermediate_size=24, num_hidden_layers=n,
        num_key_value_heads=spec["num_attention_heads"], mlp_layer_types=["dense"] + ["sparse"] * (n - 1),
        pad_token_id=0, bos_token_id=1, eos_token_id=2, **spec,
    )


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Non-trivial values for what an HF init leaves at 0/1: norms, gate params, conv taps, router bias."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if name.endswith("A_log"):
                t.copy_(torch.empty(t.shape).uniform_(1, 16, generator=gen).log())
            elif name.endswith("dt_bias"):
                t.copy_(torch.randn(t.shape, generator=gen) * 0.5)
            elif name.endswith("conv1d.weight"):
                t.copy_(torch.randn(t.shape, generator=gen) * 0.4)
            elif name.endswith("e_score_correction_bias"):
                t.copy_(torch.randn(t.shape, generator=gen) * 0.05)
            elif "norm" in name:
                t.copy_(1 + 0.2 * torch.randn(t.shape, generator=gen))
            elif t.dim() >= 2:
                t.copy_(torch.randn(t.shape, generator=gen) * 0.08)


def _remote_code_config(hf_cfg: dict) -> dict:
    """The same model in the original remote-code spelling (spec §2.1): 1-based lists, no layer_types."""
    types = hf_cfg["layer_types"]
    mlp = hf_cfg["mlp_layer_types"]
    first_dense = mlp.index("sparse")
    assert all(t == "sparse" for t in mlp[first_dense:])
    drop = {"layer_types", "mlp_layer_types", "linear_num_heads", "linear_head_dim", "linear_conv_kernel_dim",
            "num_experts", "num_experts_per_token", "num_shared_experts", "num_expert_group", "model_max_length"}
    cfg = {k: v for k, v in hf_cfg.items() if k not in drop}
    cfg.update(
        linear_attn_config={
            "num_heads": hf_cfg["linear_num_heads"],
            "head_dim": hf_cfg["linear_head_dim"],
            "short_conv_kernel_size": hf_cfg["linear_conv_kernel_dim"],
            "kda_layers": [i + 1 for i, t in enumerate(types) if t == "linear_attention"],
            "full_attn_layers": [i + 1 for i, t in enumerate(types) if t == "full_attention"],
        },
        first_k_dense_replace=first_dense,
        moe_layer_freq=1,
        num_experts=hf_cfg["num_experts"],
        num_experts_per_token=hf_cfg["num_experts_per_token"],
        num_shared_experts=hf_cfg["num_shared_experts"],
        num_expert_group=hf_cfg["num_expert_group"],
        use_grouped_topk=True,
        moe_router_activation_func="sigmoid",
        mla_use_nope=True,
        model_max_length=hf_cfg["model_max_length"],
        head_dim=72,  # the remote config's unused default; must be ignored
    )
    return cfg


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def oracle(request, tmp_path_factory):
    """(checkpoint dir written by transformers, HF model, prompt, HF logits [T, V])."""
    torch.manual_seed(0)
    model = KimiLinearForCausalLM(_hf_config(CONFIGS[request.param])).float().eval()
    _randomize(model, seed=sorted(CONFIGS).index(request.param))
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    ids = torch.randint(3, 101, (PROMPT_LEN,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(ids[None], use_cache=False).logits[0].float()
    return path, model, ids, logits


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


def _hyserve_logits(path: Path, ids: torch.Tensor) -> torch.Tensor:
    return load_model(str(path), dtype="float32").score(ids.tolist())


def test_save_pretrained_writes_original_checkpoint_names(oracle):
    path = oracle[0]
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    assert any(".self_attn.q_conv1d.weight" in k for k in keys)
    assert any(".block_sparse_moe.experts.0.w1.weight" in k for k in keys)
    assert not any("forget_gate" in k or "gate_up_proj" in k for k in keys)


def test_logits_match_transformers_with_its_own_config_json(oracle):
    path, _, ids, want = oracle
    assert _rel_err(_hyserve_logits(path, ids), want) < REL_TOL


def test_logits_match_transformers_with_remote_code_config(oracle, tmp_path):
    path, _, ids, want = oracle
    shutil.copy(path / "model.safetensors", tmp_path / "model.safetensors")
    hf_cfg = json.loads((path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(_remote_code_config(hf_cfg)))
    assert _rel_err(_hyserve_logits(tmp_path, ids), want) < REL_TOL


def test_logits_match_transformers_with_runtime_tensor_names(oracle, tmp_path):
    """transformers-5 runtime spelling: conv1d concatenated, forget_gate.*, mlp.experts.gate_up_proj."""
    path, model, ids, want = oracle
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    assert any(k.endswith("self_attn.conv1d.weight") for k in state)
    assert any(k.endswith("forget_gate.A_log") for k in state)
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)
    save_file(state, str(tmp_path / "model.safetensors"))
    shutil.copy(path / "config.json", tmp_path / "config.json")
    assert _rel_err(_hyserve_logits(tmp_path, ids), want) < REL_TOL


GREEDY_TOKENS = 32


def transformers_greedy(model, prompt: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
    """n greedy tokens from the oracle, each from a full forward pass (no cache format to get wrong),
    with the logits each choice was made from."""
    seq, logits = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            row = model(torch.tensor([seq]), use_cache=False).logits[0, -1].float()
            logits.append(row)
            seq.append(int(row.argmax()))
    return seq[len(prompt):], logits


def assert_greedy_matches(got: list[int], want: list[int], logits: list[torch.Tensor], tol: float = 1e-4) -> None:
    """Equal tokens, except that from the first difference on the oracle's own logits must show a near
    tie (its choice and ours within tol of its logit range): a rounding-level flip, not a defect."""
    for i, (g, w) in enumerate(zip(got, want)):
        if g != w:
            row = logits[i]
            gap = float(row[w] - row[g]) / float(row.max() - row.min())
            assert gap <= tol, f"token {i}: hyserve chose {g}, transformers {w}; logit gap {gap:.2e} of the range"
            return
    assert len(got) == len(want)


def hyserve_greedy(path: Path, prompt: list[int], n: int, device: str) -> list[int]:
    """n greedy tokens through the whole engine (scheduler, cache, sampler), float32 weights."""
    from hyserve import LLM, SamplingParams
    from hyserve.config import EngineConfig
    from hyserve.engine.llm_engine import LLMEngine
    from hyserve.tokenizer import load_tokenizer

    model = load_model(str(path), dtype="float32", device=device)
    tokenizer = load_tokenizer(None, model.config.tokenizer_family)  # the checkpoint has none: ids in, ids out
    engine = LLMEngine(EngineConfig(model=str(path), dtype="float32", device=device), model=model, tokenizer=tokenizer)
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    return list(LLM.from_engine(engine).generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids)


def test_greedy_generation_matches_transformers(oracle):
    path, model, ids, _ = oracle
    prompt = ids[:24].tolist()
    want, logits = transformers_greedy(model, prompt, GREEDY_TOKENS)
    assert_greedy_matches(hyserve_greedy(path, prompt, GREEDY_TOKENS, "cpu"), want, logits)
