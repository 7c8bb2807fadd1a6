"""The DSpark block drafter (DSpark, DeepSeek; DFlash's backbone): one non-causal forward drafts a block.

Input: the last accepted token followed by block_size - 1 mask embeddings, at positions a .. a+γ-1;
block position j predicts the token at a+1+j. Context: the hidden states of chosen target layers at
every position before a, concatenated, projected to the hidden size and normed (fc, hidden_norm), and
injected as extra keys/values in every draft layer: each layer's MLA turns them into latent rows
(normed latent | rotated shared rope key) exactly as it turns the block into rows, and the block's
queries attend to all context rows and to the whole block (no causal mask inside it).
The target's embedding and lm_head are shared, not copied: their logits are the base U_j; a low-rank
Markov head adds B(x_{j-1}) = W2 W1[x_{j-1}] from the token drafted before (the anchor for j = 0), so
drafting is a loop of (add bias, draw) over the block and q_j = softmax(U_j + B) is the exact
distribution each draft came from. The confidence head predicts draft j's acceptance from h_j and
W1[x_{j-1}], never from x_j, which keeps confidence-scheduled verification exact
(hyserve/spec_decode/confidence.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hyserve.models.layers.activation import GLU
from hyserve.models.layers.moe import DenseMLP
from hyserve.models.layers.norm import RMSNorm
from hyserve.models.layers.rope import Rotary


@dataclass
class DSparkConfig:
    hidden_size: int  # the target's (embedding and lm_head are shared)
    vocab_size: int
    target_layer_ids: list[int]  # 0-based target layers whose outputs are the context features
    block_size: int = 7  # drafts per forward (γ)
    num_layers: int = 2
    num_heads: int = 6
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 16
    v_head_dim: int = 32
    kv_lora_rank: int = 64
    intermediate_size: int = 768
    markov_rank: int = 64
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 4096

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> DSparkConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


def _linear(i: int, o: int) -> nn.Linear:
    return nn.Linear(i, o, bias=False)


class DraftMLA(nn.Module):
    """MLA over [context rows; block rows] with the block's queries, non-causal inside the block."""

    def __init__(self, cfg: DSparkConfig):
        super().__init__()
        h, self.dn, self.dr, self.dv, self.rank = (cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                                                    cfg.v_head_dim, cfg.kv_lora_rank)
        self.num_heads, self.block_size = h, cfg.block_size
        self.q_proj = _linear(cfg.hidden_size, h * (self.dn + self.dr))
        self.kv_a_proj_with_mqa = _linear(cfg.hidden_size, self.rank + self.dr)
        self.kv_a_layernorm = RMSNorm(self.rank, cfg.rms_norm_eps)
        self.kv_b_proj = _linear(self.rank, h * (self.dn + self.dv))
        self.o_proj = _linear(h * self.dv, cfg.hidden_size)
        self.rotary = Rotary(self.dr, cfg.rope_theta, None, cfg.max_position_embeddings)

    def rows(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """[..., rank + dr] latent rows of x [..., D] at positions [...]: what a cache would keep."""
        ckv = self.kv_a_proj_with_mqa(x)
        flat = positions.reshape(-1)
        rope = Rotary.apply(ckv[..., self.rank :].reshape(flat.shape[0], self.dr), *self.rotary.cos_sin(flat))
        return torch.cat([self.kv_a_layernorm(ckv[..., : self.rank]), rope.view(*x.shape[:-1], self.dr)], -1)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, ctx_rows: torch.Tensor,
                ctx_visible: torch.Tensor) -> torch.Tensor:
        """x [B, Q, D]: one or more blocks of block_size inputs at positions [B, Q]; ctx_rows
        [B, L, rank + dr]; ctx_visible [B, Q, L] bool (the context rows each query sees). A query sees
        every row of its own block and none of another block's."""
        b, q_len, _ = x.shape
        h = self.num_heads
        q = self.q_proj(x).view(b, q_len, h, self.dn + self.dr)
        cos, sin = self.rotary.cos_sin(positions.reshape(-1))
        q_rope = Rotary.apply(q[..., self.dn :].reshape(b * q_len, h, self.dr), cos, sin).view(b, q_len, h, self.dr)
        rows = torch.cat([ctx_rows.to(x.dtype), self.rows(x, positions)], 1)  # [B, L + Q, rank + dr]
        kv = self.kv_b_proj(rows[..., : self.rank]).view(b, rows.shape[1], h, self.dn + self.dv)
        k = torch.cat([kv[..., : self.dn], rows[..., None, self.rank :].expand(-1, -1, h, -1)], -1)
        qq = torch.cat([q[..., : self.dn], q_rope], -1)
        mask = torch.cat([ctx_visible, self._block_mask(ctx_visible, q_len)], -1)  # [B, Q, L + Q]
        o = F.scaled_dot_product_attention(qq.transpose(1, 2), k.transpose(1, 2), kv[..., self.dn :].transpose(1, 2),
                                           attn_mask=mask.unsqueeze(1), scale=(self.dn + self.dr) ** -0.5)
        return self.o_proj(o.transpose(1, 2).reshape(b, q_len, h * self.dv))

    def _block_mask(self, like: torch.Tensor, q_len: int) -> torch.Tensor:
        block = torch.arange(q_len, device=like.device) // self.block_size
        return (block[:, None] == block[None, :]).expand(like.shape[0], -1, -1)


class DraftLayer(nn.Module):
    def __init__(self, cfg: DSparkConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DraftMLA(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = DenseMLP(cfg.hidden_size, cfg.intermediate_size, GLU("silu"))

    def forward(self, x, positions, ctx_rows, ctx_visible) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, ctx_rows, ctx_visible)
        return x + self.mlp(self.post_attention_layernorm(x))


class DSparkDrafter(nn.Module):
    """The drafter's own weights; `share_target` hands it the target's embedding and lm_head, which stay
    the target's (no copy, not in this module's state dict)."""

    def __init__(self, cfg: DSparkConfig):
        super().__init__()
        self.config = cfg
        d = cfg.hidden_size
        self.fc = _linear(len(cfg.target_layer_ids) * d, d)
        self.hidden_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.mask_embeds = nn.Parameter(torch.zeros(cfg.block_size - 1, d))
        self.layers = nn.ModuleList(DraftLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(d, cfg.rms_norm_eps)
        self.markov_in = nn.Embedding(cfg.vocab_size, cfg.markov_rank)  # W1
        self.markov_out = _linear(cfg.markov_rank, cfg.vocab_size)  # W2
        self.confidence = nn.Linear(d + cfg.markov_rank, 1)
        self._shared: tuple[nn.Embedding, nn.Linear] | None = None  # a tuple: not registered as submodules

    def share_target(self, embed_tokens: nn.Embedding, lm_head: nn.Linear) -> DSparkDrafter:
        if embed_tokens.weight.shape[1] != self.config.hidden_size or lm_head.weight.shape[0] != self.config.vocab_size:
            raise ValueError("the target's embedding / lm_head do not match the drafter's hidden and vocab sizes")
        self._shared = (embed_tokens, lm_head)
        return self

    def _target(self) -> tuple[nn.Embedding, nn.Linear]:
        if self._shared is None:
            raise RuntimeError("call share_target(embed_tokens, lm_head) before running the drafter")
        return self._shared

    def context_rows(self, features: torch.Tensor, positions: torch.Tensor) -> list[torch.Tensor]:
        """Per draft layer, the latent rows of target features [..., m*D] at positions [...]: computed once
        per target token and kept for every later block (the drafter's KV cache)."""
        ctx = self.hidden_norm(self.fc(features))
        return [layer.self_attn.rows(ctx, positions) for layer in self.layers]

    def hidden(self, anchors: torch.Tensor, anchor_pos: torch.Tensor, ctx_rows: list[torch.Tensor],
               ctx_visible: torch.Tensor) -> torch.Tensor:
        """Final-normed hidden states [B, A*γ, D] of A blocks per batch row: anchors [B, A] (the last
        accepted token of each block), anchor_pos [B, A], ctx_rows per layer [B, L, rank + dr],
        ctx_visible [B, A*γ, L]."""
        embed, _ = self._target()
        b, a = anchors.shape
        g = self.config.block_size
        first = embed(anchors).unsqueeze(2)  # [B, A, 1, D]
        masks = self.mask_embeds.to(first.dtype).expand(b, a, g - 1, -1)
        x = torch.cat([first, masks], 2).reshape(b, a * g, -1)
        positions = (anchor_pos.unsqueeze(-1) + torch.arange(g, device=anchors.device)).reshape(b, a * g)
        for layer, rows in zip(self.layers, ctx_rows):
            x = layer(x, positions, rows, ctx_visible)
        return self.norm(x)

    def drafting_bytes(self) -> int:
        """Weight bytes one drafting call reads: its own parameters but the Markov head's W1, an embedding
        table of which only the drafted tokens' rows are read (as of the shared embedding: neither is
        counted), plus the shared lm_head, read whole for the draft logits. `parameters()` holds none of
        the shared tensors (`_shared` is a tuple, not a submodule)."""
        skip = self.markov_in.weight
        own = sum(p.numel() * p.element_size() for p in self.parameters() if p is not skip)
        lm_head = self._target()[1].weight
        return own + lm_head.numel() * lm_head.element_size()

    def base_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._target()[1](hidden).float()

    def markov_bias(self, prev_ids: torch.Tensor) -> torch.Tensor:
        return self.markov_out(self.markov_in(prev_ids)).float()

    def confidence_logits(self, hidden: torch.Tensor, prev_ids: torch.Tensor) -> torch.Tensor:
        """Logit of draft j's acceptance from h_j and the token before it (never draft j itself)."""
        feats = torch.cat([hidden, self.markov_in(prev_ids).to(hidden.dtype)], -1)
        return self.confidence(feats).squeeze(-1).float()

    def teacher_forced_logits(self, hidden: torch.Tensor, prev_ids: torch.Tensor) -> torch.Tensor:
        """Draft logits U_j + B(x_{j-1}) with the true previous tokens (training); prev_ids like hidden[..., 0]."""
        return self.base_logits(hidden) + self.markov_bias(prev_ids)
