"""Next-token training of KimiForCausalLM and HF-format checkpoints (config.json in the K3 format with
1-based layer lists, model.safetensors in the checkpoint spelling the loader reads, tokenizer files).

Time-boxed: the cosine schedule runs on max(step / max_steps, elapsed / time_budget), so a run that is
cut by its wall-clock budget still ends at the bottom of the schedule. Steps have one fixed shape
(hyserve/train/rows.py) and the compile/autotune pass runs before the clock starts.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hyserve.models.checkpoint_writer import write_checkpoint
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
    cfg["eos_token_id"] = list(eos)  # stop on <|end_of_msg|> and [EOS] (docs/ARCHITECTURE.md §8.1)
    return cfg


@dataclass
class TrainConfig:
    lr: float = 2e-3
    min_lr_ratio: float = 0.05
    warmup_steps: int = 50  # linear learning-rate warm-up (the compile warm-up pass is separate)
    weight_decay: float = 0.1
    rows: int = 32  # every step is rows x row_len tokens (hyserve/train/rows.py)
    row_len: int = 1024
    max_steps: int = 10**9
    autotune_configs: int = 0  # >0: keep this many configs per fla autotuner (limit_fla_autotune)
    time_budget_s: float = float("inf")  # wall clock of the training steps, counted after the warm-up pass
    grad_clip: float = 1.0
    bias_update_rate: float = 1e-3  # aux-loss-free router balancing (DeepSeek-V3 style)
    seed: int = 0
    log_every: int = 10


@dataclass
class TrainLog:
    losses: list[float]  # every log_every steps, and the first five
    steps: int = 0
    tokens: int = 0  # rows x row_len per step, padding included
    trained_tokens: int = 0  # targets the loss saw
    warmup_s: float = 0.0  # the untimed compile/autotune pass
    step_s: float = 0.0  # one steady-state step, timed in the warm-up
    train_s: float = 0.0
    budget_s: float = 0.0
    used_fla: bool = False

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / max(self.train_s, 1e-9)


def new_model(raw_config: dict, device: str | torch.device, seed: int = 0) -> KimiForCausalLM:
    model = build_model(parse_config(raw_config), torch.float32, device)
    random_init(model, seed)
    return model.train().requires_grad_(True)


def lr_at(cfg: TrainConfig, step: int, elapsed: float) -> float:
    """Linear warm-up, then cosine to min_lr_ratio over whichever ends first: max_steps or the budget.

    By wall clock as well as steps, so a run cut by its budget still ends at the bottom of the schedule
    whatever its throughput turned out to be (elapsed starts after the compile warm-up pass)."""
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
        self.reset()

    def reset(self) -> None:
        self.counts = dict.fromkeys(self.counts)


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def train(
    model: KimiForCausalLM, examples: Sequence[Example], cfg: TrainConfig, *, pad_id: int, use_fla: bool = True,
    progress: bool = True, deadline: float = float("inf"),
) -> TrainLog:
    """Train in place on fixed-shape steps. Two untimed forward+backward passes on the first batch come
    first (kernel compilation and autotuning, then one steady step to time); the wall-clock budget and
    the schedule cover the training steps only, and end by `deadline` (a time.perf_counter() value)."""
    from hyserve.train.packed import limit_fla_autotune, row_batch, row_lm_loss, scratch_cache
    from hyserve.train.rows import row_batches

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
    batches = row_batches(examples, cfg.rows, cfg.row_len, pad_id, cfg.seed)
    batch = row_batch(cfg.rows, cfg.row_len, dev)  # constant: every step has this shape
    cache = scratch_cache(model, batch)
    step_tokens = cfg.rows * cfg.row_len
    log = TrainLog(losses=[])

    plan = model.kernel_plan.for_training(fla=use_fla)
    log.used_fla = plan.train_fla

    def loss_of(rb) -> torch.Tensor:
        with autocast:
            return row_lm_loss(model, rb, batch, cache, plan)

    if log.used_fla and cfg.autotune_configs:
        print(f"fla autotuners trimmed to {cfg.autotune_configs} configs: "
              f"{limit_fla_autotune(cfg.autotune_configs)}", flush=True)
    first = next(batches)
    t0 = time.perf_counter()
    for i in range(2):  # compile + autotune, then a steady pass to time; no optimizer step
        t1 = time.perf_counter()
        loss_of(first).backward()
        opt.zero_grad(set_to_none=True)
        _sync(dev)
        if i == 0:
            log.warmup_s = time.perf_counter() - t0
    log.step_s = time.perf_counter() - t1
    balancer.reset()
    # what is left of the deadline once the warm-up is paid for bounds the schedule's budget
    cfg = dataclasses.replace(cfg, time_budget_s=min(cfg.time_budget_s, deadline - time.perf_counter()))
    log.budget_s = min(cfg.time_budget_s, 1e12)  # JSON has no inf
    if progress:
        planned = min(cfg.max_steps, int(cfg.time_budget_s / max(log.step_s, 1e-9)))
        print(f"warm-up {log.warmup_s:.1f}s; a step of {step_tokens} tokens takes {log.step_s * 1e3:.0f} ms "
              f"(fla={log.used_fla}): about {planned} steps in the budget", flush=True)
    start = time.perf_counter()
    for step, rb in enumerate(batches):
        elapsed = time.perf_counter() - start
        if step >= cfg.max_steps or elapsed >= cfg.time_budget_s:
            break
        for group in opt.param_groups:
            group["lr"] = lr_at(cfg, step, elapsed)
        loss = loss_of(rb)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        balancer.update()
        log.steps, log.tokens = step + 1, log.tokens + step_tokens
        log.trained_tokens += rb.trained_tokens
        if step % cfg.log_every == 0 or step < 5:
            log.losses.append(loss.item())  # a host sync, only at log points
            if progress:
                dt = time.perf_counter() - start
                print(f"step {step} loss {log.losses[-1]:.3f} lr {opt.param_groups[0]['lr']:.2e} "
                      f"{log.tokens / dt:,.0f} tok/s {dt:.0f}s", flush=True)
    _sync(dev)
    log.train_s = time.perf_counter() - start
    model.eval().requires_grad_(False)
    return log


# ---- checkpoints -----------------------------------------------------------------------------------


def save_checkpoint(model: KimiForCausalLM, raw_config: dict, tokenizer_dir: str, out_dir: str,
                    dtype: torch.dtype = torch.bfloat16, shard_bytes: int = 15 << 20) -> None:
    """The HF-format directory (hyserve/models/checkpoint_writer.py), in shards of at most `shard_bytes`
    so every file stays small enough to move around."""
    write_checkpoint(model, raw_config, out_dir, dtype, shard_bytes, tokenizer_dir)
