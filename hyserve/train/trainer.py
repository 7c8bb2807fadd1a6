"""Next-token training of KimiForCausalLM and HF-format checkpoints (config.json in the K3 format with
1-based layer lists, model.safetensors in the checkpoint spelling the loader reads, tokenizer files).

Time-boxed: the cosine schedule runs on max(step / max_steps, elapsed / time_budget), so a run that is
cut by its wall-clock budget still ends at the bottom of the schedule.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hyserve.models.config import parse_config
from hyserve.models.kimi import KimiForCausalLM
from hyserve.models.layers.moe import Router
from hyserve.models.loader import build_model, random_init
from hyserve.models.presets import _k3

Example = tuple[list[int], list[int]]  # (ids, loss mask)

# name -> shape kwargs of presets._k3; "small" is the shipped model (about 22M parameters)
SIZES = {
    "small": dict(hidden=384, layers=8, heads=6, kda_heads=6, head_dim=64, q_lora=192, kv_lora=128, nope=64,
                  rope=32, v=64, inter=1024, experts=8, topk=2, shared=1, moe_inter=256, latent=128, block=4,
                  full_attn=[4, 8]),
    "toy": dict(hidden=64, layers=4, heads=2, kda_heads=2, head_dim=16, q_lora=32, kv_lora=32, nope=16, rope=8,
                v=16, inter=128, experts=4, topk=2, shared=1, moe_inter=32, latent=32, block=2, full_attn=[4]),
}


def k3_config(size: str, vocab: int, bos: int, eos: Sequence[int], pad: int, max_len: int = 4096) -> dict:
    cfg = _k3(vocab=vocab, max_len=max_len, bos=bos, eos=eos[0], pad=pad, **SIZES[size])
    cfg["eos_token_id"] = list(eos)  # stop on <|end_of_msg|> and [EOS] (serving.md §1a)
    return cfg


@dataclass
class TrainConfig:
    lr: float = 2e-3
    min_lr_ratio: float = 0.05
    warmup_steps: int = 50
    weight_decay: float = 0.1
    batch_tokens: int = 32768
    max_steps: int = 10**9
    time_budget_s: float = float("inf")
    grad_clip: float = 1.0
    bias_update_rate: float = 1e-3  # aux-loss-free router balancing (DeepSeek-V3 style)
    seed: int = 0
    log_every: int = 10


def new_model(raw_config: dict, device: str | torch.device, seed: int = 0) -> KimiForCausalLM:
    model = build_model(parse_config(raw_config), torch.float32, device)
    random_init(model, seed)
    return model.train().requires_grad_(True)


def batches(examples: Sequence[Example], batch_tokens: int, rng: random.Random):
    """Endless shuffled batches of whole examples, about `batch_tokens` tokens each."""
    while True:
        order = list(range(len(examples)))
        rng.shuffle(order)
        cur, n = [], 0
        for i in order:
            cur.append(examples[i])
            n += len(examples[i][0])
            if n >= batch_tokens:
                yield cur
                cur, n = [], 0
        if cur:  # an epoch's remainder: a batch never spans epochs, however small the data
            yield cur


def lr_at(cfg: TrainConfig, step: int, elapsed: float) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, max(step / cfg.max_steps, elapsed / cfg.time_budget_s))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


class _RouterBalancer:
    """Counts expert picks per router; after each step nudges the selection-only bias toward balance."""

    def __init__(self, model: KimiForCausalLM, rate: float):
        self.rate = rate
        self.routers = [m for m in model.modules() if isinstance(m, Router)]
        self.counts = {id(r): None for r in self.routers}
        for r in self.routers:
            r.e_score_correction_bias.requires_grad_(False)
            r.register_forward_hook(self._hook)

    def _hook(self, router, _inputs, out) -> None:
        ids = out[0].detach().reshape(-1)
        c = torch.bincount(ids, minlength=router.weight.shape[0]).float()
        prev = self.counts[id(router)]
        self.counts[id(router)] = c if prev is None else prev + c

    @torch.no_grad()
    def update(self) -> None:
        for r in self.routers:
            c = self.counts[id(r)]
            if c is not None and self.rate:
                r.e_score_correction_bias += self.rate * torch.sign(c.mean() - c)
            self.counts[id(r)] = None


def train(
    model: KimiForCausalLM, examples: Sequence[Example], cfg: TrainConfig, *, use_fla: bool = True,
    progress: bool = True,
) -> list[float]:
    """Train in place; returns the per-step losses."""
    from tqdm import tqdm

    from hyserve.train.packed import masked_lm_loss, training_kernels

    dev = model.device
    balancer = _RouterBalancer(model, cfg.bias_update_rate)
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8, fused=dev.type == "cuda",
    )
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if dev.type == "cuda" else torch.autocast("cpu", enabled=False)
    rng = random.Random(cfg.seed)
    losses: list[float] = []
    start = time.perf_counter()
    tokens = 0
    bar = tqdm(total=None if cfg.max_steps >= 10**9 else cfg.max_steps, disable=not progress, dynamic_ncols=True,
               mininterval=2.0)
    with training_kernels(model, enable=use_fla):
        for step, batch in enumerate(batches(examples, cfg.batch_tokens, rng)):
            elapsed = time.perf_counter() - start
            if step >= cfg.max_steps or elapsed >= cfg.time_budget_s:
                break
            for group in opt.param_groups:
                group["lr"] = lr_at(cfg, step, elapsed)
            with autocast:
                loss, _ = masked_lm_loss(model, [b[0] for b in batch], [b[1] for b in batch])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
            opt.step()
            balancer.update()
            tokens += sum(len(b[0]) for b in batch)
            if step % cfg.log_every == 0 or step < 5:
                losses.append(loss.item())
                rate = tokens / max(time.perf_counter() - start, 1e-9)
                bar.set_postfix(loss=f"{losses[-1]:.3f}", tok_s=f"{rate:,.0f}", lr=f"{opt.param_groups[0]['lr']:.2e}")
            bar.update(1)
    bar.close()
    model.eval().requires_grad_(False)
    return losses


# ---- checkpoints -----------------------------------------------------------------------------------

_FP32_SUFFIXES = ("A_log", "dt_bias", "conv1d.weight", "o_norm.weight", "e_score_correction_bias", "gate.weight")


def checkpoint_tensors(model: KimiForCausalLM) -> dict[str, torch.Tensor]:
    """State dict in the K3 checkpoint spelling: per-expert w1/w2/w3, q/k/v conv1d, o_norm, AttnRes
    `*_norm` / `*_proj` weights (the names `hyserve.models.loader` maps back)."""
    cfg = model.config
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        t = t.detach().cpu()
        if name.endswith("block_sparse_moe.w13"):
            base, inter = name[: -len("w13")], t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{base}experts.{e}.w1.weight"] = t[e, :inter]
                out[f"{base}experts.{e}.w3.weight"] = t[e, inter:]
        elif name.endswith("block_sparse_moe.w2"):
            base = name[: -len("w2")]
            for e in range(t.shape[0]):
                out[f"{base}experts.{e}.w2.weight"] = t[e]
        elif name.endswith("self_attn.conv_weight"):
            base, p = name[: -len("conv_weight")], cfg.kda_proj_dim
            for j, part in enumerate("qkv"):
                out[f"{base}{part}_conv1d.weight"] = t[j * p : (j + 1) * p].unsqueeze(1)
        elif name.endswith("self_attn.o_norm_weight"):
            out[name.replace("o_norm_weight", "o_norm.weight")] = t
        elif name.endswith(("res.proj", "res.norm")):
            out[name[: -len(".proj")] + "_" + name.rsplit(".", 1)[1] + ".weight"] = t
        else:
            out[name] = t
    return {k: v.contiguous() for k, v in out.items()}


def save_checkpoint(model: KimiForCausalLM, raw_config: dict, tokenizer_dir: str, out_dir: str,
                    dtype: torch.dtype = torch.bfloat16, shard_bytes: int = 15 << 20) -> None:
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    tensors = {k: (v.float() if k.endswith(_FP32_SUFFIXES) else v.to(dtype)) for k, v in checkpoint_tensors(model).items()}
    # shards of at most `shard_bytes`, with the HF index, so every file stays small enough to move around
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for k, v in tensors.items():
        n = v.numel() * v.element_size()
        if shards[-1] and size + n > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][k] = v
        size += n
    if len(shards) == 1:
        save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, os.path.join(out_dir, fname), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, fname))
        total = sum(v.numel() * v.element_size() for v in tensors.values())
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    config = dict(raw_config, dtype={torch.bfloat16: "bfloat16", torch.float32: "float32"}[dtype])
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(tokenizer_dir, name), os.path.join(out_dir, name))
