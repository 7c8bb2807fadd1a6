"""A rank's model: the single-device model classes built at the rank's shapes, with the parallel layers
swapped in through their module attributes (tp_layers.py, moe.py, dcp_mla.py), and the parameters filled
either from a single-device model (`shard_model`) or by the loader, slice by slice (sharding.py)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from hyserve.distributed.config import check_model_splits
from hyserve.distributed.context import StepContext
from hyserve.distributed.dcp_mla import DCPMLAttention
from hyserve.distributed.moe import ParallelMoE
from hyserve.distributed.sharding import param_specs
from hyserve.distributed.tp_layers import (
    TPDenseMLP,
    TPKimiDeltaAttention,
    TPMLAttention,
    VocabParallelEmbedding,
    vocab_parallel_logits,
)
from hyserve.models.batch import Batch, CacheTensors
from hyserve.models.config import ModelConfig, with_changes
from hyserve.models.device_init import materialize
from hyserve.models.kimi import KimiForCausalLM
from hyserve.models.layers.moe import glu_of
from hyserve.ops.kernel_plan import KernelPlan, active


def local_config(cfg: ModelConfig, tp: int, expert_parallel: bool = False) -> ModelConfig:
    """The shapes one of `tp` ranks holds: heads, the dense width and vocab rows divided, and the routed and
    shared experts' width unless the experts are split by expert instead (EP). The rank model's kernel plan
    and cache are planned from these."""
    moe_inter = cfg.moe_intermediate_size if expert_parallel else cfg.moe_intermediate_size // tp
    return with_changes(
        cfg, num_attention_heads=cfg.num_attention_heads // tp, kda_num_heads=cfg.kda_num_heads // tp,
        intermediate_size=cfg.intermediate_size // tp, vocab_size=math.ceil(cfg.vocab_size / tp),
        moe_intermediate_size=moe_inter,
    )


class ParallelCausalLM(KimiForCausalLM):
    """The model as one rank runs it. `config` holds the rank's shapes (so `make_cache` sizes the rank's
    state slots: its KDA heads only, and `kernel_plan` is decided for the rank's projections); `full_config`
    is the model's. forward and compute_logits have the single-device contract: replicated hidden states
    [T, D] and full fp32 logits [T, vocab] on every rank."""

    def __init__(self, cfg: ModelConfig, ctx: StepContext):
        tp = ctx.state.tp.size
        local = local_config(cfg, tp, expert_parallel=ctx.state.ep.size > 1)
        super().__init__(local)
        self.full_config, self.ctx = cfg, ctx
        m = self.model
        m.embed_tokens = VocabParallelEmbedding(local.vocab_size, cfg.hidden_size, ctx.state.tp.rank * local.vocab_size,
                                                cfg.vocab_size, ctx)
        dcp = ctx.state.dcp.size > 1
        for i, layer in enumerate(m.layers):
            if cfg.layer_types[i] == "kda":
                layer.self_attn = TPKimiDeltaAttention(local, cfg.kda_layers.index(i), ctx)
            elif dcp:
                layer.self_attn = DCPMLAttention(local, cfg.mla_layers.index(i), ctx)
            else:
                layer.self_attn = TPMLAttention(local, cfg.mla_layers.index(i), ctx)
            if cfg.mlp_types[i] == "moe":
                layer.block_sparse_moe = ParallelMoE(cfg, ctx)
            else:
                layer.mlp = TPDenseMLP(cfg.hidden_size, local.intermediate_size, glu_of(cfg), ctx)

    def forward(self, input_ids: torch.Tensor, batch: Batch, cache: CacheTensors,
                plan: KernelPlan | None = None) -> torch.Tensor:
        """The single-device forward over the rank's layers, each handed `plan` (default: the rank model's
        `kernel_plan`, decided from its shapes)."""
        self.ctx.num_tokens = int(input_ids.shape[0])
        hidden = self.model(input_ids, batch, cache, active(plan or self.kernel_plan))
        return self.ctx.gather_tokens(hidden) if self.ctx.sequence_parallel else hidden

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        logits = vocab_parallel_logits(hidden, self.lm_head.weight, self.full_config.vocab_size, self.ctx,
                                       active(self.kernel_plan))
        return logits if out is None else out.copy_(logits)


def build_rank_model(cfg: ModelConfig, ctx: StepContext, device: str | torch.device,
                     param_dtype: Callable[[str], torch.dtype]) -> ParallelCausalLM:
    """The rank's model with uninitialised parameters of the dtype `param_dtype(name)` gives, for the
    loader to fill (sharding.py says which slice of each checkpoint tensor goes where)."""
    if cfg.is_deepseek_v32:
        raise NotImplementedError("tensor parallelism is built for the Kimi models; DeepSeek V3.2 is not yet split")
    check_model_splits(cfg, ctx.state.config)
    with torch.device("meta"):
        model = ParallelCausalLM(cfg, ctx)
    return materialize(model, param_dtype, device).eval().requires_grad_(False)


def shard_model(model: KimiForCausalLM, ctx: StepContext) -> ParallelCausalLM:
    """This rank's copy of a single-device model, each parameter cut by its shard spec."""
    full = dict(model.named_parameters())
    rank_model = build_rank_model(model.config, ctx, model.device, lambda n: full[n].dtype)
    specs = param_specs(model.config, ctx.state.config, full)
    rank = ctx.state.tp.rank
    for name, p in rank_model.named_parameters():
        p.data.copy_(specs[name].take(full[name].data, rank))
    return rank_model
