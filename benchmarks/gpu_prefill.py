"""Prefill throughput of the kimi-linear-48b-a3b preset (random weights): one fresh sequence of 2K, 8K and
32K tokens, FLOPs counted, against the bf16 matmul rate measured in the same run.

    python benchmarks/gpu_prefill.py
    python benchmarks/gpu_prefill.py --lengths 2048,8192 --fla-configs 4   # a shorter device call

--fla-configs N keeps N configs per fla-core autotuner (its full autotune takes minutes before the first
step); the kernels it picks may then be a little slower than the full search would pick."""

from __future__ import annotations

import argparse
import sys

import torch
from gpu_common import MODEL_48B, active_params_per_token, ceilings, report, time_ms

from hyserve.models.batch import Batch
from hyserve.models.loader import load_model


def prefill_flops(cfg, t: int) -> float:
    gemm = 2 * active_params_per_token(cfg) * t
    h = cfg.num_attention_heads
    attn = len(cfg.mla_layers) * h * 2 * (cfg.qk_head_dim + cfg.v_head_dim) * t * (t + 1) / 2  # causal
    attn += len(cfg.mla_layers) * 2 * t * cfg.kv_lora_rank * h * (cfg.qk_nope_head_dim + cfg.v_head_dim)  # kv_b
    kda = len(cfg.kda_layers) * t * cfg.kda_num_heads * 2 * 4 * cfg.kda_head_dim**2  # about 4 K×V products
    return gemm + attn + kda


def prefill_step_fn(model, ids: torch.Tensor, bs: int = 64):
    """One fresh sequence of len(ids) tokens through the model, the last token's logits."""
    t = ids.shape[0]
    blocks = (t + bs - 1) // bs
    cache = model.make_cache(blocks + 1, bs, 2)
    batch = Batch.build([t], [t], [list(range(blocks))], bs, [0], [True], ids.device.type)

    def step():
        with torch.inference_mode():
            return model.compute_logits(model(ids, batch, cache)[-1:])

    return step


def main(model=None, ceil=None, lengths=(2048, 8192, 32768), command: str = "python benchmarks/gpu_prefill.py",
         note: str = "") -> None:
    ceil = ceil or ceilings()
    model = model or load_model(MODEL_48B, device="cuda")
    cfg = model.config
    rows = ["| tokens | ms | tokens/s | TFLOP | achieved | matmul-rate floor | floor/time |",
            "|---|---|---|---|---|---|---|"]
    for t in lengths:
        step = prefill_step_fn(model, torch.randint(0, cfg.vocab_size, (t,), device="cuda"))
        ms = time_ms(step, 1, 3)
        fl = prefill_flops(cfg, t)
        floor = fl / (ceil["mm_tflops"] * 1e12) * 1e3
        rows.append(f"| {t} | {ms:.1f} | {t / ms * 1e3:.0f} | {fl / 1e12:.1f} | {fl / ms / 1e9:.0f} TFLOP/s | "
                    f"{floor:.1f} ms | {floor / ms:.0%} |")
        print(rows[-1], flush=True)
        del step  # and with it the cache
        torch.cuda.empty_cache()
    report("Prefill, kimi-linear-48b-a3b (random bf16 weights), one sequence", command,
           rows, [note + f"Ceilings in this run: copy {ceil['copy_tbs']:.2f} TB/s, bf16 matmul {ceil['mm_tflops']:.0f} "
                  "TFLOP/s. FLOPs: active GEMMs (8 routed + shared expert, lm_head for one token counted as all "
                  "tokens), causal MLA attention in the expanded form, kv_b up-projection, KDA ≈ 4 K×V products "
                  "per token and head. transformers 5.17 on the same shape (notes/h200.md, not re-run here): "
                  "2K 106 ms, 8K 321 ms."], "prefill.md")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", default="2048,8192,32768")
    p.add_argument("--fla-configs", type=int, default=None, help="configs kept per fla autotuner (default: all)")
    args = p.parse_args()
    note = ""
    if args.fla_configs:
        from hyserve.train.packed import limit_fla_autotune

        limit_fla_autotune(args.fla_configs)
        note = f"fla-core's autotuners kept {args.fla_configs} configs each. "
    main(lengths=[int(t) for t in args.lengths.split(",")],
         command=" ".join(["python benchmarks/gpu_prefill.py", *sys.argv[1:]]), note=note)
