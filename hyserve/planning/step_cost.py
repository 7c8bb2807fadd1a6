"""What one engine step costs: the bytes it must move and the FLOPs it must compute, part by part, and the
floor those set at a device's ceilings (planning/ceilings.py).

A step holds `decodes` one-token sequences, each attending to `decode_context` tokens, and `prefill`
tokens in `chunks` equal chunks, each over `prefill_context` cached tokens (ARCHITECTURE.md §4.1: one
flattened forward for all of them). The parts:

- dense weights: every weight but the embedding table and the routed experts is read once a step; GEMMs
  run on every token, the lm_head only on the rows that sample (one per decode and per chunk);
- routed experts: each MoE layer reads the experts its tokens pick, E·(1 − (1 − k/E)^T) of them in
  expectation under uniform routing (all 256 of the 48B's by a few hundred tokens); GEMMs of k a token;
- attention: MLA rows (and DSA index keys) read once per sequence; decodes in the absorbed form (2R + d_r
  per head and key), chunks in the expanded form (the kv_b up-projection of every row, then (d_qk + d_v)
  per head and key, causal) or, past `index_topk` with an indexer, sparse absorbed over the top-k plus
  the indexer's scores of every key;
- KDA state: each sequence's recurrent and conv state read and written once; the delta rule per token.

`floor_s` is the roofline of the whole step, max(bytes / copy, FLOPs / matmul): no step can be faster.
`sequential_floor_s` sums each part's own roofline, what kernels that do not overlap one another reach.
Activations and the KV rows a step writes are left out (small beside the weights at these shapes).
"""

from __future__ import annotations

from dataclasses import dataclass

from hyserve.models.config import ModelConfig
from hyserve.models.param_counts import expert_params, param_groups
from hyserve.planning.ceilings import DeviceCeilings


@dataclass(frozen=True)
class StepShape:
    decodes: int = 0
    decode_context: int = 0  # tokens each decode attends to, its own included
    prefill: int = 0  # prefill tokens of the step, split evenly over `chunks` sequences
    prefill_context: int = 0  # tokens each chunk's sequence has cached before it
    chunks: int = 1

    @property
    def tokens(self) -> int:
        return self.decodes + self.prefill

    @property
    def num_chunks(self) -> int:
        return self.chunks if self.prefill else 0

    def describe(self) -> str:
        parts = []
        if self.decodes:
            parts.append(f"{self.decodes} decodes over {self.decode_context}")
        if self.prefill:
            n = f"{self.chunks} chunks of {self.prefill // self.chunks}" if self.chunks > 1 else f"a {self.prefill}-token chunk"
            parts.append(f"{n} over {self.prefill_context} cached")
        return " + ".join(parts) or "empty"


@dataclass(frozen=True)
class Part:
    name: str
    bytes: float
    flops: float

    def seconds(self, ceil: DeviceCeilings) -> float:
        return max(self.bytes / ceil.copy_bytes_per_s, self.flops / ceil.matmul_flops_per_s)


@dataclass(frozen=True)
class StepCost:
    shape: StepShape
    parts: tuple[Part, ...]

    @property
    def bytes(self) -> float:
        return sum(p.bytes for p in self.parts)

    @property
    def flops(self) -> float:
        return sum(p.flops for p in self.parts)

    def part(self, name: str) -> Part:
        return next(p for p in self.parts if p.name == name)

    @property
    def weight_bytes(self) -> float:
        return self.part("dense weights").bytes + self.part("routed experts").bytes

    @property
    def gemm_flops(self) -> float:
        return self.part("dense weights").flops + self.part("routed experts").flops

    def floor_s(self, ceil: DeviceCeilings) -> float:
        return max(self.bytes / ceil.copy_bytes_per_s, self.flops / ceil.matmul_flops_per_s)

    def sequential_floor_s(self, ceil: DeviceCeilings) -> float:
        return sum(p.seconds(ceil) for p in self.parts)

    def describe(self, ceil: DeviceCeilings) -> str:
        return (f"{self.shape.describe()}: {self.bytes / 1e9:.1f} GB ({self.bytes / ceil.copy_bytes_per_s * 1e3:.1f} ms), "
                f"{self.flops / 1e12:.2f} TFLOP ({self.flops / ceil.matmul_flops_per_s * 1e3:.1f} ms); floor "
                f"{self.floor_s(ceil) * 1e3:.1f} ms, part by part {self.sequential_floor_s(ceil) * 1e3:.1f} ms")


class StepCostModel:
    """The cost of any step of one model; `weight_bytes` / `kv_bytes`: bytes per weight and per cached value."""

    def __init__(self, config: ModelConfig, weight_bytes: int = 2, kv_bytes: int = 2):
        c = self.config = config
        self.wb, self.kvb = weight_bytes, kv_bytes
        g = param_groups(c)
        self.n_moe, self.n_mla, self.n_kda = c.mlp_types.count("moe"), len(c.mla_layers), len(c.kda_layers)
        self.expert = expert_params(c)
        self.lm_head, self.embedding_width = g["lm_head"], c.hidden_size
        self.dense = sum(g.values()) - g["embedding"] - g["routed_experts"]  # lm_head included
        rec, conv = c.kda_state_bytes(conv_dtype_bytes=kv_bytes)
        self.state_bytes = rec + conv
        self.row_bytes = c.kv_row_width * kv_bytes  # one MLA layer's row of one token
        self.index_bytes = c.index_key_bytes_per_layer(raw_dtype_bytes=kv_bytes) if c.has_indexer else 0

    def distinct_experts(self, tokens: int) -> float:
        """Expected experts of one MoE layer that `tokens` tokens touch (uniform routing)."""
        e, k = self.config.num_experts, self.config.num_experts_per_tok
        return e * (1 - (1 - k / e) ** tokens) if self.n_moe and tokens else 0.0

    def weight_bytes(self, tokens: int) -> float:
        """Weight bytes a step of `tokens` tokens reads."""
        return self.wb * (self.dense + tokens * self.embedding_width + self.n_moe * self.distinct_experts(tokens) * self.expert)

    def cost(self, s: StepShape) -> StepCost:
        t, sampled = s.tokens, s.decodes + s.num_chunks
        dense = Part("dense weights", self.wb * (self.dense + t * self.embedding_width),
                     2.0 * (t * (self.dense - self.lm_head) + sampled * self.lm_head))
        experts = Part("routed experts", self.wb * self.n_moe * self.distinct_experts(t) * self.expert,
                       2.0 * t * self.config.num_experts_per_tok * self.expert * self.n_moe)
        state = Part("KDA state", 2.0 * self.state_bytes * (s.decodes + s.num_chunks),
                     2.0 * 3 * t * self.n_kda * self.config.kda_num_heads * self.config.kda_head_dim ** 2)
        return StepCost(s, (dense, experts, self._attention(s), state))

    def _attention(self, s: StepShape) -> Part:
        c = self.config
        h, r, dr = c.num_attention_heads, c.kv_lora_rank, c.qk_rope_head_dim
        absorbed = 2.0 * h * (2 * r + dr)  # FLOPs per (query, key) in the absorbed form
        index = 2.0 * c.index_n_heads * c.index_head_dim if c.has_indexer else 0.0
        topk = c.index_topk if c.has_indexer else None

        def attended(n: int) -> int:
            return n if topk is None else min(n, topk)

        ctx = s.decode_context
        nbytes = s.decodes * (attended(ctx) * self.row_bytes + ctx * self.index_bytes)
        flops = s.decodes * (attended(ctx) * absorbed + ctx * index)
        if s.prefill:
            q, cached = s.prefill // s.chunks, s.prefill_context
            rows = cached + q
            pairs = q * cached + q * (q + 1) / 2
            nbytes += s.chunks * rows * (self.row_bytes + self.index_bytes)
            if topk is not None and rows > topk:
                # query i (1-based) attends to min(cached + i, topk) keys; the indexer scores all of them
                m = max(0, min(topk - cached, q))
                kept = m * cached + m * (m + 1) / 2 + (q - m) * topk
                flops += s.chunks * (kept * absorbed + pairs * index)
            else:
                expand = 2.0 * rows * r * h * (c.qk_nope_head_dim + c.v_head_dim)
                flops += s.chunks * (expand + pairs * 2.0 * h * (c.qk_head_dim + c.v_head_dim) + pairs * index)
        return Part("attention", nbytes * self.n_mla, flops * self.n_mla)
