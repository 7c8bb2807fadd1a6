"""The Kimi model family assembled from layers by config flags: Kimi Linear and Kimi K3.

Kimi Linear: plain pre-norm residuals. K3: Block AttnRes replaces the residual stream (docs/ARCHITECTURE.md §4.6).
"""

from __future__ import annotations

import torch
from torch import nn

from hyserve.models.batch import Batch, CacheTensors
from hyserve.models.config import ModelConfig
from hyserve.models.layers.attn_res import AttnRes
from hyserve.models.layers.kda import KimiDeltaAttention
from hyserve.models.layers.mla import MLAttention
from hyserve.models.layers.moe import DenseMLP, MoE, glu_of
from hyserve.models.layers.norm import RMSNorm, add_rms_norm
from hyserve.ops.dense_gemv import linear
from hyserve.ops.device_spec import DeviceSpec
from hyserve.ops.kernel_plan import KernelPlan, active, plan_kernels
from hyserve.ops.moe_gemv import PairParts


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__()
        kind = cfg.layer_types[index]
        if kind == "kda":
            self.self_attn = KimiDeltaAttention(cfg, cfg.kda_layers.index(index))
        else:
            self.self_attn = MLAttention(cfg, cfg.mla_layers.index(index))
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.mlp_types[index] == "moe":
            self.block_sparse_moe = MoE(cfg)
        else:
            self.mlp = DenseMLP(cfg.hidden_size, cfg.intermediate_size, glu_of(cfg))
        if cfg.attn_res_block_size:
            self.self_attention_res = AttnRes(cfg.hidden_size, cfg.rms_norm_eps)
            self.mlp_res = AttnRes(cfg.hidden_size, cfg.rms_norm_eps)

    def attn(self, x: torch.Tensor, batch: Batch, cache: CacheTensors, plan: KernelPlan) -> torch.Tensor:
        return self.self_attn(self.input_layernorm(x), batch, cache, plan)

    def ffn(self, x: torch.Tensor, plan: KernelPlan) -> torch.Tensor:
        return self.mlp_out(self.post_attention_layernorm(x), plan)

    def mlp_out(self, h: torch.Tensor, plan: KernelPlan, summed: bool = True) -> torch.Tensor | PairParts:
        """The MLP or MoE on already-normed input (summed=False: see `MoE.forward`)."""
        if hasattr(self, "block_sparse_moe"):
            return self.block_sparse_moe(h, summed=summed, plan=plan)
        return self.mlp(h, plan)


class KimiModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.block = cfg.attn_res_block_size
        if self.block:
            self.output_attn_res = AttnRes(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, batch: Batch, cache: CacheTensors, plan: KernelPlan,
                segments=None) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        n = segments.size_for(x.shape[0], plan) if segments is not None else None
        if n is not None:  # every layer's MLP half replayed from a graph
            h = segments.begin(x, n)
            for i, layer in enumerate(self.layers):
                h = segments.after_attention(i, layer.self_attn(h, batch, cache, plan))
            return h
        if not self.block:
            # each residual add runs with the pre-norm that follows it (one kernel on the GPU)
            h = self.layers[0].input_layernorm(x)
            norms = [layer.input_layernorm for layer in self.layers[1:]] + [self.norm]
            for layer, next_norm in zip(self.layers, norms):
                post = layer.post_attention_layernorm
                x, h = add_rms_norm(x, layer.self_attn(h, batch, cache, plan), post.weight, post.eps)
                x, h = add_rms_norm(x, layer.mlp_out(h, plan, summed=False), next_norm.weight, next_norm.eps)
            return h
        prefix: torch.Tensor | None = x
        blocks: list[torch.Tensor] = []
        for i, layer in enumerate(self.layers):
            h = layer.self_attention_res(blocks, prefix) if blocks else prefix
            if i % self.block == 0:
                blocks.append(prefix)
                prefix = None
            a = layer.attn(h, batch, cache, plan)
            prefix = a if prefix is None else prefix + a
            prefix = prefix + layer.ffn(layer.mlp_res(blocks, prefix), plan)
        return self.norm(self.output_attn_res(blocks, prefix))


class KimiForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = KimiModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def kernel_plan(self) -> KernelPlan:
        """Which kernel each layer runs (ops/kernel_plan.py), decided when the model is built on its
        device; decided again only after the model has moved to another device or dtype."""
        key = (str(self.device), self.dtype)
        if self.__dict__.get("_planned_for") != key:
            self._plan = plan_kernels(self.config, DeviceSpec.of(self.device), self.dtype)
            self._planned_for = key
        return self._plan

    def forward(self, input_ids: torch.Tensor, batch: Batch, cache: CacheTensors,
                plan: KernelPlan | None = None, segments=None) -> torch.Tensor:
        """Final-normed hidden states [T, D] for the flattened step; reads and writes `cache`. The layers
        run the kernels of `plan`: the model's `kernel_plan` by default; for training on packed fresh
        sequences (train/packed.py), `kernel_plan.for_training()`, the same function through batched,
        differentiable layer paths. `segments` (models/segment_graphs.SegmentGraphs, the engine's): the
        layers' MLP halves replayed from its graphs where a size fits the step."""
        return self.model(input_ids, batch, cache, active(plan or self.kernel_plan), segments)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 logits [T, vocab]; into `out` when given (one conversion kernel instead of a cast and a copy)."""
        w = self.lm_head.weight
        config = active(self.kernel_plan).linear_gemv(hidden, w, out)
        if out is not None:
            return linear(hidden, w, out=out, config=config)
        return linear(hidden, w, config=config).float()

    def make_cache(self, num_blocks: int, block_size: int, num_slots: int, dtype: torch.dtype | None = None) -> CacheTensors:
        cfg, dev = self.config, self.device
        dtype = dtype or self.dtype
        p = cfg.kda_proj_dim
        index_keys = None
        if cfg.has_indexer:
            width = cfg.index_key_bytes_per_layer(raw_dtype_bytes=torch.finfo(dtype).bits // 8)
            index_keys = torch.zeros(num_blocks, len(cfg.mla_layers), block_size, width, dtype=torch.uint8, device=dev)
        return CacheTensors(
            pages=torch.zeros(num_blocks, len(cfg.mla_layers), block_size, cfg.kv_row_width, dtype=dtype, device=dev),
            conv=torch.zeros(num_slots, len(cfg.kda_layers), 3 * p, cfg.conv_kernel_size - 1, dtype=dtype, device=dev),
            recurrent=torch.zeros(
                num_slots, len(cfg.kda_layers), cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_head_dim,
                dtype=torch.float32, device=dev,
            ),
            index_keys=index_keys,
        )

    @torch.inference_mode()
    def score(self, token_ids: list[int], block_size: int = 64) -> torch.Tensor:
        """Float32 logits [T, vocab] for one sequence from an empty state, through the engine's layers."""
        n = len(token_ids)
        if n == 0:
            raise ValueError("score() needs at least one token")
        blocks = (n + block_size - 1) // block_size
        cache = self.make_cache(blocks, block_size, 1)
        batch = Batch.build([n], [n], [list(range(blocks))], block_size, [0], [True], self.device)
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        return self.compute_logits(self.forward(ids, batch, cache))
