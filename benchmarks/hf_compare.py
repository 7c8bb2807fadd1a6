"""hyserve against transformers' KimiLinearForCausalLM on the same weights, in the same run (issue 6, item 2).

A layer-reduced variant of the kimi-linear-48b-a3b shape: its first --layers layers with the full model's
layer shapes (layer 0: KDA + the dense 9216-wide MLP; layers 1-2: KDA + 256-expert MoE; layer 3: MLA + MoE;
then the pattern repeats), the full embedding and lm_head. The weights are drawn once, in the transformers
model, and copied into hyserve's by its checkpoint loader; a short prompt's last logits from both are
compared first, so a wrong copy shows. Both models then run, one after the other, on the same GPU:
decode steps at batch 1, 8 and 64 after --context tokens each (hyserve: one step replayed from a CUDA
graph; transformers: forward calls with its cache) and one-sequence prefills (last-token logits only, in
both). transformers uses fla-core's kernels where fla-core is importable.

    python benchmarks/hf_compare.py                                   # one H200; appends to docs/BENCHMARKS.md
    python benchmarks/hf_compare.py --device cpu --tiny --no-append   # dry run: a tiny float32 config
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from gpu_common import report, time_ms
from gpu_decode import decode_step_fn, graphed
from gpu_prefill import prefill_step_fn

from hyserve.models.config import parse_config
from hyserve.models.loader import build_model, load_tensors
from hyserve.models.presets import preset_config

TINY = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_attention_heads=4,
            num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
            linear_attn_config={"num_heads": 4, "head_dim": 16, "short_conv_kernel_size": 4,
                                "kda_layers": [1, 2, 3], "full_attn_layers": [4]},
            num_experts=16, num_experts_per_token=2, vocab_size=512)


def hf_config(preset: dict, layers: int):
    """transformers' KimiLinearConfig of the preset (the remote-code format, 1-based layer lists) cut to its
    first `layers` layers."""
    from transformers import KimiLinearConfig

    lin = preset["linear_attn_config"]
    kinds = ["linear_attention" if i + 1 in lin["kda_layers"] else "full_attention" for i in range(layers)]
    dense = preset.get("first_k_dense_replace", 0)
    return KimiLinearConfig(
        vocab_size=preset["vocab_size"], hidden_size=preset["hidden_size"],
        intermediate_size=preset["intermediate_size"], moe_intermediate_size=preset["moe_intermediate_size"],
        num_hidden_layers=layers, num_attention_heads=preset["num_attention_heads"],
        num_key_value_heads=preset["num_key_value_heads"], n_shared_experts=preset["num_shared_experts"],
        routed_scaling_factor=preset.get("routed_scaling_factor", 1.0), kv_lora_rank=preset["kv_lora_rank"],
        q_lora_rank=preset.get("q_lora_rank"), qk_rope_head_dim=preset["qk_rope_head_dim"],
        v_head_dim=preset["v_head_dim"], qk_nope_head_dim=preset["qk_nope_head_dim"],
        n_group=preset.get("num_expert_group", 1), topk_group=preset.get("topk_group", 1),
        num_experts_per_tok=preset["num_experts_per_token"], norm_topk_prob=preset.get("moe_renormalize", True),
        hidden_act=preset.get("hidden_act", "silu"), rms_norm_eps=preset["rms_norm_eps"],
        num_local_experts=preset["num_experts"], layer_types=kinds,
        mlp_layer_types=["dense" if i < dense else "sparse" for i in range(layers)],
        linear_num_heads=lin["num_heads"], linear_head_dim=lin["head_dim"],
        linear_conv_kernel_dim=lin["short_conv_kernel_size"], tie_word_embeddings=False,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )


def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Weights of the usual scale, and values an HF init leaves at 0 or 1 made non-trivial (norms, decay
    parameters, conv taps, the router's correction bias), drawn on the model's device."""
    gen = torch.Generator(next(model.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for name, t in model.named_parameters():
            r = torch.empty(t.shape, device=t.device, dtype=torch.float32)
            if name.endswith("A_log"):
                t.copy_(r.uniform_(1, 16, generator=gen).log())
            elif name.endswith("dt_bias"):
                t.copy_(r.normal_(0, 0.5, generator=gen))
            elif "conv1d" in name:
                t.copy_(r.normal_(0, 0.4, generator=gen))
            elif name.endswith("e_score_correction_bias"):
                t.copy_(r.normal_(0, 0.05, generator=gen))
            elif "norm" in name:
                t.copy_(r.normal_(1, 0.1, generator=gen))
            else:
                t.copy_(r.normal_(0, 0.02, generator=gen))


def build_pair(preset: dict, layers: int, device: str, dtype: torch.dtype):
    """(transformers model, hyserve model) holding the same weights."""
    from transformers import KimiLinearForCausalLM

    cfg = hf_config(preset, layers)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # transformers builds in the default dtype: no float32 copy on the way
    try:
        with torch.device(device):
            hf = KimiLinearForCausalLM(cfg).to(dtype).eval()
        randomize_(hf, seed=0)
    finally:
        torch.set_default_dtype(old)
    # the product loader's path for a checkpoint's tensors (the config as save_pretrained writes it, with
    # the architecture), fed from memory instead of a directory
    ours = build_model(parse_config({**cfg.to_dict(), "architectures": ["KimiLinearForCausalLM"]}), dtype, device)
    load_tensors(ours, hf.state_dict().items())
    return hf, ours


def wall_ms(fn, device: str, warmup: int = 2, iters: int = 8) -> float:
    if device == "cuda":
        return time_ms(fn, warmup, iters)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def hf_prefill_fn(hf, ids: torch.Tensor):
    def step():
        with torch.inference_mode():
            return hf(input_ids=ids[None], use_cache=True, logits_to_keep=1).logits[0, -1:]

    return step


def hf_decode_fn(hf, n: int, ctx: int, vocab: int, device: str):
    """transformers: n sequences prefilled with ctx tokens, then one decode forward per call (greedy)."""
    gen = torch.Generator(device).manual_seed(n)
    ids = torch.randint(3, vocab, (n, ctx), device=device, generator=gen)
    with torch.inference_mode():
        out = hf(input_ids=ids, use_cache=True, logits_to_keep=1)
    state = {"cache": out.past_key_values, "tok": out.logits[:, -1:].argmax(-1)}

    def step():
        with torch.inference_mode():
            o = hf(input_ids=state["tok"], past_key_values=state["cache"], use_cache=True)
            state["tok"] = o.logits[:, -1:].argmax(-1)

    return step


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batches", default="1,8,64")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--lengths", default="2048,8192")
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="a tiny config in float32 (a dry run of the script)")
    p.add_argument("--no-append", action="store_true", help="print only; leave docs/BENCHMARKS.md alone")
    p.add_argument("--fla-configs", type=int, default=None,
                   help="configs kept per fla-core autotuner, for both models (default: all)")
    args = p.parse_args(argv)
    dev = args.device
    if args.fla_configs:
        from hyserve.train.packed import limit_fla_autotune

        limit_fla_autotune(args.fla_configs)
    preset = preset_config("kimi-linear-48b-a3b")
    if args.tiny:
        preset = {**preset, **TINY}
    dtype = torch.float32 if args.tiny else torch.bfloat16
    hf, ours = build_pair(preset, args.layers, dev, dtype)
    vocab = ours.config.vocab_size

    # the same weights: one prompt's last logits from both
    ids = torch.randint(3, vocab, (64,), device=dev, generator=torch.Generator(dev).manual_seed(0))
    check = rel_err(prefill_step_fn(ours, ids)(), hf_prefill_fn(hf, ids)())
    print(f"last-token logits, hyserve vs transformers: relative error {check:.2e}", flush=True)

    rows = ["| workload | hyserve ms | transformers ms | transformers / hyserve |", "|---|---|---|---|"]
    for n in [int(b) for b in args.batches.split(",")]:
        step, cache = decode_step_fn(ours, n, args.context, device=dev)
        greedy = lambda step=step: step().argmax(-1)  # noqa: E731 - a pick, as transformers' step makes
        if dev == "cuda":
            ours_ms, what = time_ms(graphed(greedy), 2, 10), "CUDA graph"
        else:  # the CPU dry run
            ours_ms, what = wall_ms(greedy, dev), "eager"
        del step, cache, greedy
        theirs = wall_ms(hf_decode_fn(hf, n, args.context, vocab, dev), dev)
        rows.append(f"| decode, batch {n}, context {args.context} (hyserve: {what}) | {ours_ms:.2f} | "
                    f"{theirs:.2f} | {theirs / ours_ms:.1f}x |")
        print(rows[-1], flush=True)
        _free(dev)
    for t in [int(x) for x in args.lengths.split(",")]:
        ids = torch.randint(3, vocab, (t,), device=dev, generator=torch.Generator(dev).manual_seed(t))
        ours_ms = wall_ms(prefill_step_fn(ours, ids), dev, 1, 3)
        _free(dev)
        theirs = wall_ms(hf_prefill_fn(hf, ids), dev, 1, 3)
        rows.append(f"| prefill, {t} tokens, one sequence | {ours_ms:.1f} | {theirs:.1f} | {theirs / ours_ms:.1f}x |")
        print(rows[-1], flush=True)
        _free(dev)
    lin = preset["linear_attn_config"]
    kinds = ", ".join("KDA" if i + 1 in lin["kda_layers"] else "MLA" for i in range(args.layers))
    notes = [f"Layer-reduced variant: the first {args.layers} layers of kimi-linear-48b-a3b ({kinds}; layer 0 with "
             f"the dense MLP, the rest with the {preset['num_experts']}-expert MoE), full embedding and lm_head, random "
             f"{str(dtype).removeprefix('torch.')} weights drawn once and loaded into both. The last-token "
             f"logits of a 64-token prompt agree to a relative error of {check:.1e}.",
             "Decode: the median time of one step after each sequence's context, a greedy pick included "
             "(hyserve: the model's step, on a GPU replayed from a CUDA graph; transformers: one forward call "
             "with its cache). Prefill: one fresh sequence, last-token logits. transformers "
             f"{_version('transformers')}, fla-core {_version('fla')} (its kernels when importable)"
             + (f"; fla-core's autotuners kept {args.fla_configs} configs each." if args.fla_configs else ".")]
    if args.no_append or dev != "cuda":
        print("\n".join(rows + [""] + notes))
        return
    report("hyserve against transformers on the same weights, kimi-linear-48b-a3b layer-reduced",
           " ".join(["python benchmarks/hf_compare.py", *(argv if argv is not None else sys.argv[1:])]), rows, notes,
           "hf_compare.md")


def _free(dev: str) -> None:
    if dev == "cuda":
        torch.cuda.empty_cache()


def _version(module: str) -> str:
    try:
        return __import__(module).__version__
    except Exception:  # not importable: reported as such
        return "not installed"


if __name__ == "__main__":
    main()
