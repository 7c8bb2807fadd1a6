"""Training a DSpark drafter against a frozen target (hyserve/spec_decode/dspark.py; the objective is in
hyserve/train/dspark_loss.py).

Every step runs the target over fixed-shape rows (hyserve/train/rows.py) once, without gradients, and
reads two things off that forward: the hidden states of the drafter's target layers at every position
(the context features, hyserve/spec_decode/target_features.py) and the target's logits at the block
positions of the sampled anchors (the soft labels). Only the drafter learns; the target's embedding and
lm_head are shared with it and stay frozen. The target runs its training plan (`kernel_plan.for_training()`,
docs/ARCHITECTURE.md §7.3: fla chunk_kda on CUDA with fla-core), under bf16 autocast like the drafter.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from hyserve.spec_decode.dspark import DSparkConfig, DSparkDrafter
from hyserve.spec_decode.target_features import default_layer_ids, tap_features
from hyserve.train.dspark_loss import LossWeights, block_index, draft_loss, sample_anchors

Example = tuple[list[int], list[int]]


@dataclass
class DrafterTrainConfig:
    block_size: int = 7
    num_layers: int = 2
    layer_ids: list[int] | None = None  # None: DFlash's spread of 3 layers
    anchors: int = 64  # blocks per row and step
    rows: int = 32
    row_len: int = 1024
    lr: float = 1e-3
    min_lr_ratio: float = 0.05
    warmup_steps: int = 30
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    max_steps: int = 10**9
    time_budget_s: float = float("inf")
    seed: int = 0
    log_every: int = 20
    weights: LossWeights = field(default_factory=LossWeights)


@dataclass
class DrafterTrainLog:
    losses: list[float] = field(default_factory=list)
    tau_t1: list[float] = field(default_factory=list)
    tau_greedy: list[float] = field(default_factory=list)
    steps: int = 0
    warmup_s: float = 0.0
    train_s: float = 0.0
    used_fla: bool = False


def new_drafter(model, cfg: DrafterTrainConfig, seed: int = 0) -> DSparkDrafter:
    tc = model.config
    dc = DSparkConfig(hidden_size=tc.hidden_size, vocab_size=tc.vocab_size,
                      target_layer_ids=cfg.layer_ids or default_layer_ids(tc.num_hidden_layers),
                      block_size=cfg.block_size, num_layers=cfg.num_layers,
                      intermediate_size=2 * tc.hidden_size, max_position_embeddings=tc.max_position_embeddings)
    torch.manual_seed(seed)
    drafter = DSparkDrafter(dc)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if name.endswith("weight") and p.dim() == 2 and "markov_in" not in name:
                p.normal_(0.0, 0.02)
        drafter.markov_in.weight.normal_(0.0, 0.02)
        drafter.markov_out.weight.zero_()  # the Markov bias starts at zero: the base logits alone
        drafter.mask_embeds.normal_(0.0, 0.02)
        drafter.confidence.weight.zero_()
        drafter.confidence.bias.zero_()
    return drafter.to(model.lm_head.weight.device).share_target(model.model.embed_tokens, model.lm_head)


class TargetPass:
    """The frozen target over one fixed-shape step: context features and logits at the block positions."""

    def __init__(self, model, layer_ids: Sequence[int], rows: int, row_len: int, use_fla: bool = True):
        from hyserve.train.packed import row_batch, scratch_cache

        self.model, self.layer_ids, self.rows, self.row_len = model, list(layer_ids), rows, row_len
        self.dev = model.lm_head.weight.device
        self.batch = row_batch(rows, row_len, self.dev)
        self.cache = scratch_cache(model, self.batch)
        self.plan = model.kernel_plan.for_training(fla=use_fla)

    def autocast(self):
        return torch.autocast("cuda", dtype=torch.bfloat16) if self.dev.type == "cuda" else \
            torch.autocast("cpu", enabled=False)

    @torch.no_grad()
    def __call__(self, ids: torch.Tensor, anchor_pos: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        """ids [R, L] -> (features [R, L, m*D], target logits [R, A, γ, V] at a+j)."""
        pos, _ = block_index(anchor_pos, block, self.row_len)
        # the head inside autocast too: on CUDA the hidden rows leave the forward in bf16 over fp32 weights
        with tap_features(self.model, self.layer_ids) as tap, self.autocast():
            hidden = self.model(ids.reshape(-1), self.batch, self.cache, self.plan)
            sel = torch.gather(hidden.view(self.rows, self.row_len, -1), 1,
                               pos.flatten(1).unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))
            logits = self.model.lm_head(sel).float().view(*pos.shape, -1)
        return tap.features().view(self.rows, self.row_len, -1), logits


def lr_at(cfg: DrafterTrainConfig, step: int, elapsed: float) -> float:
    """Linear warm-up, then cosine to min_lr_ratio by steps or by the wall-clock budget, whichever ends first."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, max(step / cfg.max_steps, elapsed / cfg.time_budget_s))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def _step_inputs(rb, cfg: DrafterTrainConfig, gen: torch.Generator, dev: torch.device):
    ids = rb.ids.view(cfg.rows, cfg.row_len).to(dev)
    targets = rb.targets.view(cfg.rows, cfg.row_len)
    pos, keep = sample_anchors(targets, cfg.anchors, gen)
    return ids, targets.to(dev), pos.to(dev), keep.to(dev)


def train_drafter(model, examples: Sequence[Example], cfg: DrafterTrainConfig, *, pad_id: int,
                  deadline: float = float("inf"), use_fla: bool = True, progress: bool = True,
                  drafter: DSparkDrafter | None = None) -> tuple[DSparkDrafter, DrafterTrainLog]:
    """Train a new drafter (or `drafter`) on `examples` within the budget and the deadline."""
    from hyserve.train.rows import row_batches

    model.eval().requires_grad_(False)
    drafter = drafter or new_drafter(model, cfg, cfg.seed)
    drafter.train()
    dev = model.lm_head.weight.device
    target = TargetPass(model, drafter.config.target_layer_ids, cfg.rows, cfg.row_len, use_fla)
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    batches = row_batches(examples, cfg.rows, cfg.row_len, pad_id, cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    log = DrafterTrainLog(used_fla=target.plan.train_fla)

    def step(rb, lr: float | None) -> dict:
        ids, targets, pos, keep = _step_inputs(rb, cfg, gen, dev)
        feats, t_logits = target(ids, pos, cfg.block_size)
        with target.autocast():
            loss, metrics = draft_loss(drafter, ids, targets, feats, t_logits, pos, keep, cfg.weights)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if lr is not None:
            for group in opt.param_groups:
                group["lr"] = lr
            torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
            opt.step()
        return {"loss": loss, **metrics}

    t0 = time.perf_counter()
    step(next(batches), None)  # compiles and autotunes the target's kernels; no update
    log.warmup_s = time.perf_counter() - t0
    cfg = dataclasses.replace(cfg, time_budget_s=min(cfg.time_budget_s, deadline - time.perf_counter()))
    start = time.perf_counter()
    for n, rb in enumerate(batches):
        elapsed = time.perf_counter() - start
        if n >= cfg.max_steps or elapsed >= cfg.time_budget_s:
            break
        out = step(rb, lr_at(cfg, n, elapsed))
        log.steps = n + 1
        if n % cfg.log_every == 0 or n < 3:
            log.losses.append(float(out["loss"].detach()))
            log.tau_t1.append(float(out["tau_t1"]))
            log.tau_greedy.append(float(out["tau_greedy"]))
            if progress:
                print(f"step {n} loss {log.losses[-1]:.3f} ce {float(out['ce']):.3f} tv {float(out['tv']):.3f} "
                      f"tau(T=1) {log.tau_t1[-1]:.2f} tau(greedy) {log.tau_greedy[-1]:.2f} "
                      f"{time.perf_counter() - start:.0f}s", flush=True)
    log.train_s = time.perf_counter() - start
    return drafter.eval().requires_grad_(False), log


@torch.no_grad()
def evaluate_drafter(model, drafter: DSparkDrafter, examples: Sequence[Example], cfg: DrafterTrainConfig, *,
                     pad_id: int, batches: int = 4, use_fla: bool = True) -> dict:
    """Acceptance on held-out rows (the same metrics as training, averaged over `batches` steps)."""
    from hyserve.train.rows import row_batches

    dev = model.lm_head.weight.device
    target = TargetPass(model, drafter.config.target_layer_ids, cfg.rows, cfg.row_len, use_fla)
    gen = torch.Generator().manual_seed(1234)
    sums: dict[str, torch.Tensor] = {}
    stream = row_batches(examples, cfg.rows, cfg.row_len, pad_id, seed=1)
    for _ in range(batches):
        ids, targets, pos, keep = _step_inputs(next(stream), cfg, gen, dev)
        feats, t_logits = target(ids, pos, cfg.block_size)
        with target.autocast():
            loss, metrics = draft_loss(drafter, ids, targets, feats, t_logits, pos, keep, cfg.weights)
        for k, v in {"loss": loss, **metrics}.items():
            sums[k] = sums.get(k, 0) + v.float().cpu()
    out = {k: (v / batches).tolist() for k, v in sums.items()}
    return {k: (round(v, 4) if isinstance(v, float) else [round(x, 4) for x in v]) for k, v in out.items()}
